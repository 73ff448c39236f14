"""The call-site mesh, per-mesh programs, old spec semantics, ml.transform and stages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


def test_a_committed_argument_on_another_sharding_is_refused_as_jax_jit_does(mesh, mesh_4x2):
    spec = P("data", "model")
    f = ml.pjit(lambda x: x * 2, in_axis_resources=spec, out_axis_resources=spec)
    on_2x4 = jax.device_put(X, NamedSharding(mesh, spec))
    reference = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh_4x2, spec))
    with pytest.raises(ValueError, match="does not match the sharding"):
        reference(on_2x4)
    with ml.use_mesh(mesh_4x2), pytest.raises(ValueError) as info:
        f(on_2x4)
    message = str(info.value)
    assert "`x` (shape (8, 8)) is committed to" in message
    assert "P('data', 'model') on mesh {'data': 4, 'model': 2}" in message
    assert "jax.device_put" in message
    with ml.use_mesh(mesh_4x2):
        moved = f(jax.device_put(on_2x4, NamedSharding(mesh_4x2, spec)))
        with pytest.raises(ValueError, match=r"`x` .* is committed to"):
            f.lower(on_2x4)
    assert moved.sharding == NamedSharding(mesh_4x2, spec)
    np.testing.assert_array_equal(moved, X * 2)


def test_lookup_order_use_mesh_then_set_mesh_then_with_mesh(mesh, mesh_4x2, old_style):
    f = ml.pjit(lambda x: x + 1, P("data"), P("data"))
    with old_style(mesh):
        assert f(X).sharding.mesh == mesh
        with ml.use_mesh(mesh_4x2):
            assert f(X).sharding.mesh == mesh_4x2  # the newer context wins
    with jax.set_mesh(mesh_4x2):
        assert f(X).sharding.mesh == mesh_4x2


def test_none_is_replicated_and_unspecified_is_left_to_the_compiler(mesh):
    x = jax.device_put(X, NamedSharding(mesh, P("data", "model")))
    with ml.use_mesh(mesh):
        replicated = ml.pjit(lambda x: x + 1, None, None)
        compiled = replicated.lower(X).compile()
        out = replicated(X)
        unspecified = ml.pjit(lambda x: x + 1)(x)
    (x_sharding,), _ = compiled.input_shardings
    assert x_sharding.is_fully_replicated and x_sharding.mesh == mesh
    assert out.sharding.is_fully_replicated
    assert unspecified.sharding.spec == P("data", "model")  # follows the input


def test_without_a_mesh_none_and_named_shardings_need_none(mesh):
    """Old pjit: with no mesh, None is the compiler's choice and NamedShardings carry theirs."""
    np.testing.assert_array_equal(ml.pjit(lambda x: x * 2)(X), X * 2)
    np.testing.assert_array_equal(ml.pjit(lambda x: x * 2, None, None)(X), X * 2)
    np.testing.assert_array_equal(ml.pjit(lambda x, n: x * n, static_argnums=1)(X, 3), X * 3)
    named = NamedSharding(mesh, P("data"))
    out = ml.pjit(lambda x: x * 2, named, named)(X)
    assert out.sharding == named
    reference = jax.jit(lambda x: x * 2, in_shardings=named, out_shardings=named)(X)
    assert reference.sharding == out.sharding


def test_under_the_old_mesh_context_unspecified_runs_on_the_mesh(mesh, old_style):
    with old_style(mesh):
        out = ml.pjit(lambda x: x * 2)(np.asarray(X))
        made = ml.pjit(lambda: jnp.ones(4))()
    assert out.sharding.mesh == mesh and out.sharding.is_fully_replicated
    assert made.sharding.mesh == mesh
    with jax.set_mesh(mesh):  # the same as jax.jit under today's mesh context
        assert jax.jit(lambda x: x * 2)(np.asarray(X)).sharding == out.sharding


def test_only_a_top_level_list_of_argument_specs_is_a_tuple():
    x = jnp.arange(4.0)
    out = ml.pjit(lambda a: a, ([None] * 3,), [None] * 3)([x, x, x])
    assert isinstance(out, list) and len(out) == 3
    with pytest.raises(ml.PlanError, match="3 entries but <lambda> was called with 1"):
        ml.pjit(lambda a: a, [None] * 3)([x, x, x])


def test_wrapping_a_function_again_reuses_its_program(mesh):
    traces = []
    f = counted(lambda x: x + 1, traces)
    with ml.use_mesh(mesh):
        for _ in range(3):
            ml.pjit(f, P("data"), None)(X)
        ml.pjit(f, P("model"), None)(X)  # other specs: another program
    assert len(traces) == 2
    jax_traces = []
    g = counted(lambda x: x + 1, jax_traces)
    for _ in range(3):
        jax.jit(g)(X)
    assert len(jax_traces) == 1  # what jax.jit does


def test_lists_are_read_as_tuples(mesh):
    f = ml.pjit(lambda a, b: (a + b, a - b), [P("data"), None], [None, P(None, "model")])
    with ml.use_mesh(mesh):
        total, diff = f(X, X.T)
    assert total.sharding.is_fully_replicated
    assert diff.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(diff, X - X.T)


def test_keyword_arguments_are_refused_next_to_specs_unless_static(mesh):
    f = ml.pjit(lambda x, *, scale: x * scale, P("data"), P("data"))
    with ml.use_mesh(mesh), pytest.raises(ValueError, match="does not support kwargs"):
        f(X, scale=jnp.float32(3.0))  # old pjit refused them too
    f = ml.pjit(lambda x, *, scale: x * scale, P("data"), P("data"), static_argnames="scale")
    with ml.use_mesh(mesh):
        out = f(X, scale=3.0)
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
    assert kept.input_shardings[0][1] is not None
    assert dropped.input_shardings[0][1] is None  # y was pruned from the program


def test_positional_donate_argnums(mesh):
    f = ml.pjit(lambda x, y: x + y, (P("data"), P("data")), P("data"), (), (0,))
    with ml.use_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        y = jax.device_put(X, NamedSharding(mesh, P("data")))
        out = f(x, y)
    np.testing.assert_array_equal(out, 2 * X)
    assert x.is_deleted()
    assert not y.is_deleted()
