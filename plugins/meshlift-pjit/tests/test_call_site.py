"""The call-site mesh, per-mesh programs, old spec semantics, ml.transform and stages."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

X = jnp.arange(64.0).reshape(8, 8)


def counted(fn, traces):
    def wrapped(*args, **kwargs):
        traces.append(1)
        return fn(*args, **kwargs)

    return wrapped


def test_one_function_under_two_meshes_gives_outputs_on_each(mesh, mesh_4x2):
    traces = []
    spec = P("data", "model")
    f = ml.pjit(counted(lambda x: x * 2, traces), in_axis_resources=spec, out_axis_resources=spec)
    with ml.use_mesh(mesh):
        on_2x4 = f(X)
    with ml.use_mesh(mesh_4x2):
        on_4x2 = f(X)
    with ml.use_mesh(mesh):
        again = f(X)
    assert len(traces) == 2  # one program per mesh, each reused
    assert on_2x4.sharding == NamedSharding(mesh, spec)
    assert on_4x2.sharding == NamedSharding(mesh_4x2, spec)
    assert on_4x2.addressable_shards[0].data.shape == (2, 4)  # rows over data=4, cols over model=2
    assert again.sharding == NamedSharding(mesh, spec)
    np.testing.assert_array_equal(on_2x4, on_4x2)
    with ml.use_mesh(mesh_4x2):
        moved = f(on_2x4)  # an input laid out on the other mesh is moved onto this one
    assert moved.sharding == NamedSharding(mesh_4x2, spec)
    np.testing.assert_array_equal(moved, X * 4)


def test_lookup_order_use_mesh_then_set_mesh_then_with_mesh(mesh, mesh_4x2, old_style):
    f = ml.pjit(lambda x: x + 1, P("data"), P("data"))
    with old_style(mesh):
        assert f(X).sharding.mesh == mesh
        with ml.use_mesh(mesh_4x2):
            assert f(X).sharding.mesh == mesh_4x2  # the newer context wins
    with jax.set_mesh(mesh_4x2):
        assert f(X).sharding.mesh == mesh_4x2


def test_none_is_replicated_and_unspecified_is_left_to_the_compiler(mesh):
    with ml.use_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("data", "model")))
        replicated = ml.pjit(lambda x: x + 1, None, None)
        compiled = replicated.lower(X).compile()
        out = replicated(x)
        unspecified = ml.pjit(lambda x: x + 1)(x)
    assert compiled.input_shardings[0][1][0].is_fully_replicated
    assert out.sharding.is_fully_replicated
    assert unspecified.sharding.spec == P("data", "model")  # follows the input


def test_lists_are_read_as_tuples(mesh):
    f = ml.pjit(lambda a, b: (a + b, a - b), [P("data"), None], [None, P(None, "model")])
    with ml.use_mesh(mesh):
        total, diff = f(X, X.T)
    assert total.sharding.is_fully_replicated
    assert diff.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(diff, X - X.T)


def test_keyword_arguments_take_no_specs(mesh):
    f = ml.pjit(lambda x, *, scale: x * scale, P("data"), P("data"))
    with ml.use_mesh(mesh):
        out = f(X, scale=jnp.float32(3.0))
    np.testing.assert_array_equal(out, X * 3)
    assert out.sharding.spec == P("data")


def test_positional_static_argnums(mesh):
    traces = []
    f = ml.pjit(counted(lambda x, n: x * n, traces), (P("data"),), P("data"), (1,))
    with ml.use_mesh(mesh):
        np.testing.assert_array_equal(f(X, 2), X * 2)
        np.testing.assert_array_equal(f(X, 3), X * 3)
        f(X, 3)
    assert len(traces) == 2


def test_transform_with_unified_names(mesh, mesh_4x2):
    f = ml.transform("pjit", lambda x: x * 2, in_specs=P("data"), out_specs=P("model"))
    with ml.use_mesh(mesh_4x2):
        assert f(X).sharding == NamedSharding(mesh_4x2, P("model"))
    fixed = ml.transform("pjit", lambda x: x * 2, mesh=mesh, in_specs=P("data"), out_specs=P())
    np.testing.assert_array_equal(fixed(X), X * 2)
    assert fixed(X).sharding == NamedSharding(mesh, P())


def test_lower_compile_and_eval_shape(mesh):
    f = ml.pjit(lambda x: jnp.tanh(x), P("data"), P(None, "model"))
    with ml.use_mesh(mesh):
        lowered = f.lower(X)
        shape = f.eval_shape(X)
        compiled = lowered.compile()
        out = compiled(X)
    assert isinstance(lowered, ml.Lowered)
    assert '"data"=2, "model"=4' in lowered.as_text()
    np.testing.assert_allclose(out, jnp.tanh(X), rtol=1e-6)
    assert out.sharding == NamedSharding(mesh, P(None, "model"))
    assert (shape.shape, shape.dtype) == ((8, 8), jnp.float32)
    assert shape.sharding == NamedSharding(mesh, P(None, "model"))


def test_keep_unused(mesh):
    with ml.use_mesh(mesh):
        kept = ml.pjit(lambda x, y: x + 1, keep_unused=True).lower(X, X).compile()
        dropped = ml.pjit(lambda x, y: x + 1).lower(X, X).compile()
    assert kept.input_shardings[0][1][1] is not None
    assert dropped.input_shardings[0][1][1] is None  # y was pruned from the program


def test_positional_donate_argnums(mesh):
    f = ml.pjit(lambda x, y: x + y, (P("data"), P("data")), P("data"), (), (0,))
    with ml.use_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        y = jax.device_put(X, NamedSharding(mesh, P("data")))
        out = f(x, y)
    np.testing.assert_array_equal(out, 2 * X)
    assert x.is_deleted()
    assert not y.is_deleted()
