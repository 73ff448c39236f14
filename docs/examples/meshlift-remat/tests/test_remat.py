"""What is particular to the remat backend: found by entry point, remat, policy option."""

import jax
import jax.numpy as jnp
import meshlift_remat
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def test_registered_from_its_entry_point_with_its_distribution():
    assert ml.get_backend("remat") is not None
    [info] = [b for b in ml.backends() if b.name == "remat"]
    assert info.distribution == "meshlift-remat"
    assert "global-rng" in info.capabilities


def test_gradient_through_the_lifted_function_is_rematerialized(mesh):
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 16))
    forward = ml.transform(
        "remat",
        lambda m, x: jnp.sin(m(x)),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
        policy="nothing_saveable",
    )
    forward(model, x)  # places the model's arrays on the plan's shardings, outside any trace
    grad = jax.grad(lambda x: forward(model, x).sum())
    assert "remat" in str(jax.make_jaxpr(grad)(x))  # the forward pass, recomputed
    expected = jax.grad(lambda x: jnp.sin(model(x)).sum())(x)
    np.testing.assert_allclose(grad(x), expected, atol=1e-5)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="nothing_saveable"):
        ml.transform("remat", lambda x: x, policy="no_such_policy")(jnp.ones(2))


def test_the_backend_object_works_unregistered():
    f = ml.transform(meshlift_remat.BACKEND, lambda x: x * 2)
    np.testing.assert_array_equal(f(jnp.arange(3.0)), [0.0, 2.0, 4.0])
