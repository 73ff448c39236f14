"""ml.pjit under jax.vmap, jax.grad, jax.jvp and an outer ml.jit, against the unsharded function."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import meshlift as ml

PARAMS = {
    "w1": jax.random.normal(jax.random.key(0), (16, 32)) / 4,
    "w2": jax.random.normal(jax.random.key(1), (32, 16)) / 6,
}
SPECS = {"w1": P(None, "model"), "w2": P("model", None)}
X = jax.random.normal(jax.random.key(2), (8, 16))


def mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def sharded():
    return ml.pjit(mlp, in_axis_resources=(SPECS, P("data")), out_axis_resources=P("data"))


def close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-5)


def test_vmap(mesh):
    xs = jnp.stack([X, 2 * X, -X])  # made outside the mesh context: not committed to it
    with ml.use_mesh(mesh):
        got = jax.vmap(sharded(), in_axes=(None, 0))(PARAMS, xs)
    close(got, jax.vmap(mlp, in_axes=(None, 0))(PARAMS, xs))
    assert got.shape == (3, 8, 16)


def loss(f):
    return lambda params, x: jnp.mean(f(params, x) ** 2)


def test_grad_under_the_old_mesh_context(mesh, old_style):
    with old_style(mesh):
        got = jax.grad(loss(sharded()))(PARAMS, X)
    close(got, jax.grad(loss(mlp))(PARAMS, X))


def test_jitted_grad_under_use_mesh(mesh):
    with ml.use_mesh(mesh):
        got = jax.jit(jax.grad(loss(sharded())))(PARAMS, X)
    close(got, jax.grad(loss(mlp))(PARAMS, X))


def test_jvp(mesh, old_style):
    tangent = jax.tree.map(jnp.ones_like, PARAMS)
    with old_style(mesh):
        out, jvp_out = jax.jvp(lambda p: sharded()(p, X), (PARAMS,), (tangent,))
    ref, ref_jvp = jax.jvp(lambda p: mlp(p, X), (PARAMS,), (tangent,))
    close((out, jvp_out), (ref, ref_jvp))


def test_inside_an_outer_ml_jit(mesh):
    inner = sharded()
    outer = ml.jit(lambda p, x: inner(p, x) * 2, in_shardings=(None, P()), mesh=mesh)
    with ml.use_mesh(mesh):
        got = outer(PARAMS, X)
    close(got, 2 * mlp(PARAMS, X))
    assert got.sharding.spec == P("data")  # the inner out_axis_resources carries through
