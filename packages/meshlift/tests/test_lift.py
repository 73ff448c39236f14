"""The lift engine through a backend passed as an object: what a backend sees and returns."""

import array
import collections
import dataclasses
import inspect
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift import speedups
from meshlift.call.lift import Lifted


class RecordingBackend:
    """An unpublished backend: stages with jax.jit and records every StageSpec it is given."""

    def __init__(self):
        self.specs = []
        self.backend = ml.Backend(name="recording", stage=self.stage)

    def stage(self, fn, spec):
        self.specs.append(spec)
        return jax.jit(
            fn,
            in_shardings=spec.in_specs,
            out_shardings=spec.out_specs,
            donate_argnums=spec.donate_argnums,
        )


class Pair(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.arange(8.0))
        self.b = nnx.Param(jnp.ones((8, 4)))


def test_backend_object_sees_only_leaf_level_shardings():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    recorder = RecordingBackend()
    plan = ml.StateSharding({ml.path_endswith("a"): P("model"), ...: P()})

    def scale(pair, x):
        pair.a[...] = pair.a[...] * 2
        return x.sum()

    lifted = ml.transform(recorder.backend, scale, mesh=mesh, in_specs=(plan, P("data")))
    pair = Pair()
    out = lifted(pair, jnp.ones(8))
    assert float(out) == 8.0
    np.testing.assert_array_equal(pair.a[...], 2 * np.arange(8.0))
    [spec] = recorder.specs
    kept_vars, kept_leaves, donated_vars, donated_leaves = spec.in_specs
    assert kept_vars == (NamedSharding(mesh, P("model")), NamedSharding(mesh, P()))
    assert kept_leaves == (NamedSharding(mesh, P("data")),)
    assert donated_vars == donated_leaves == ()
    assert spec.mesh is mesh
    lifted(pair, jnp.ones(8))
    assert len(recorder.specs) == 1  # staged once per structure


def test_a_backend_reads_its_specs_mesh_and_options_through_its_readers():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    recorder = RecordingBackend()

    def read_specs(in_specs, out_specs, options):  # its own spelling, `rows=`
        return ml.Specs(options.get("rows", in_specs), out_specs, names=("rows", "out"))

    backend = attrs.evolve(
        recorder.backend,
        read_specs=read_specs,
        read_mesh=lambda given: (lambda: mesh) if given is None else given,
        read_options=lambda options: {k: v for k, v in options.items() if k != "rows"},
    )
    lifted = ml.transform(backend, lambda x: x * 2, rows=(P("data"),), keep_unused=True)
    assert lifted.names.in_specs == "rows" and lifted.options == {"keep_unused": True}
    assert float(lifted(jnp.ones(8)).sum()) == 16.0
    [spec] = recorder.specs
    assert spec.in_specs[1] == (NamedSharding(mesh, P("data")),)  # on the mesh read at the call
    assert spec.mesh is mesh and spec.options == {"keep_unused": True}
    with pytest.raises(ml.PlanError, match="rows has 2 entries but <lambda> was called with 1"):
        ml.transform(backend, lambda x: x, rows=(P("data"), P()))(jnp.ones(8))
    wrong = attrs.evolve(backend, read_specs=lambda i, o, options: (i, o))
    with pytest.raises(TypeError, match="backend 'recording' read its specs as tuple"):
        ml.transform(wrong, lambda x: x)


def test_unchanged_variables_are_not_returned():
    recorder = RecordingBackend()
    pair = Pair()
    b_before = pair.b[...]
    lifted = ml.transform(recorder.backend, lambda p: p.a[...].sum())
    assert float(lifted(pair)) == 28.0
    assert pair.b[...] is b_before  # nothing written back when nothing changed
    jaxpr = str(lifted.trace(pair).jaxpr)
    assert jaxpr.count("f32[8,4]") == 1  # b goes in, but does not come out


def test_pytree_of_arrays_with_a_plan():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    params = {"dense": {"kernel": jnp.ones((8, 8)), "bias": jnp.zeros(8)}}
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    lifted = ml.transform("jit", lambda p: p, mesh=mesh, in_specs=(plan,), out_specs=plan)
    with pytest.raises(ml.PlanError, match="does not match the arguments"):
        ml.transform("jit", lambda p: p, mesh=mesh, in_specs=((plan, plan),))(params)
    out = lifted(params)
    assert out["dense"]["kernel"].sharding.spec == P(None, "model")


def test_unknown_backend_lists_installed_ones():
    with pytest.raises(ml.BackendNotFoundError, match="No installed plugin provides it") as info:
        ml.transform("not_a_backend", lambda x: x)
    assert "jit" in str(info.value)


def test_a_mesh_given_as_a_dict_says_how_to_make_one():
    with pytest.raises(
        TypeError, match=r"make one with `ml.make_mesh\(\{'data': 2, 'model': 4\}\)`"
    ):
        ml.jit(lambda x: x, mesh={"data": 2, "model": 4})


def test_variable_whose_shape_changed_so_its_plan_no_longer_fits_is_named():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    forward = ml.jit(lambda m, x: m(x), in_shardings=(plan, P()), mesh=mesh)
    layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    forward(layer, jnp.ones((2, 4)))
    layer.kernel.set_value(jnp.ones((4, 6)))
    layer.bias.set_value(jnp.ones((6,)))
    kernel = layer.kernel.get_raw_value()
    with pytest.raises(
        ml.PlanError,
        match=r"`m.kernel` \(shape \(4, 6\)\) with in_shardings P\(None, 'model'\) on mesh "
        r"\{'data': 2, 'model': 4\}: dimension 1 \(size 6\) is not divisible by 4",
    ):
        forward(layer, jnp.ones((2, 4)))
    assert layer.kernel.get_raw_value() is kernel  # nothing moved or written
    # jax.jit refuses the same sharding for that shape, without a name
    with pytest.raises(ValueError, match="evenly divide"):
        jax.device_put(kernel, NamedSharding(mesh, P(None, "model")))


def test_variable_whose_rank_changed_so_its_plan_no_longer_fits_is_named():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    total = ml.jit(lambda m: m.kernel[...].sum(), in_shardings=(plan,), mesh=mesh)
    layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    total(layer)
    layer.kernel.set_value(jnp.ones((8,)))
    kernel = layer.kernel.get_raw_value()
    with pytest.raises(
        ml.PlanError,
        match=r"`m.kernel` \(shape \(8,\)\) with in_shardings P\(None, 'model'\) on mesh "
        r"\{'data': 2, 'model': 4\}: the spec has 2 entries but the array has rank 1",
    ) as info:
        total(layer)
    assert "kept_vars" not in str(info.value)  # no staged name, JAX's error is the cause
    assert layer.kernel.get_raw_value() is kernel
    # jax.jit refuses the same sharding for that rank, naming no argument
    with pytest.raises(ValueError, match="incompatible with its sharding"):
        jax.device_put(kernel, NamedSharding(mesh, P(None, "model")))


@pytest.mark.parametrize("donate", [False, True])
def test_jax_names_the_callers_arguments_in_its_own_errors(donate):
    """JAX's message says which argument, in the caller's paths, whichever staged group
    (kept or donated, Variable or other leaf) the array is in: as jax.jit says `k`."""

    def branch(m, x, y):
        return x if m.kernel[0, 0] > 0 else -y["b"][0]

    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    donated = (0, 2) if donate else ()
    for depends_on, inputs in (
        ("m.kernel", (layer, jnp.ones(2), {"b": [jnp.ones(2)]})),
        ("x", (layer, jnp.ones(2), {"b": [jnp.ones(2)]})),
        ("y.b.0", (layer, jnp.ones(2), {"b": [jnp.ones(2)]})),
    ):

        def on(m, x, y, depends_on=depends_on):
            tested = {"m.kernel": m.kernel[0, 0], "x": x[0], "y.b.0": y["b"][0][0]}[depends_on]
            return x if tested > 0 else -x

        with pytest.raises(jax.errors.TracerBoolConversionError) as info:
            ml.jit(on, donate_argnums=donated)(*inputs)
        message = str(info.value)
        assert "tracing the function on at" in message  # its own name, from JAX
        assert f"depends on the value of the argument {depends_on}.\n" in message
    with pytest.raises(jax.errors.TracerBoolConversionError, match="the argument k"):
        jax.jit(lambda k, x: x if k[0, 0] > 0 else -x)(layer.kernel[...], jnp.ones(2))


def test_jax_names_each_array_of_a_variable_holding_a_pytree():
    class Holder(nnx.Module):
        def __init__(self, value):
            self.tree = nnx.Param(value)

    def branch(m):
        return m.tree.get_value()["b"][1][0] > 0 and 1.0

    with pytest.raises(jax.errors.TracerBoolConversionError, match=r"argument m\.tree\.b\.1\."):
        ml.jit(branch)(Holder({"a": jnp.ones(1), "b": [jnp.ones(2), jnp.ones(3)]}))
    # another model of the same class, its Variable holding another structure: its own names
    lifted = ml.jit(lambda m: m.tree.get_value()["c"][0] > 0 and 1.0)
    with pytest.raises(jax.errors.TracerBoolConversionError, match=r"argument m\.tree\.c\."):
        lifted(Holder({"a": jnp.ones(1), "c": jnp.ones(2)}))
    with pytest.raises(jax.errors.TracerBoolConversionError, match=r"argument m\.tree\.c\."):
        lifted(Holder({"a": jnp.ones(1), "b": jnp.ones(3), "c": jnp.ones(2)}))
    # the same Variable made to hold another structure: JAX is told its new arrays' names
    holder = Holder(jnp.ones(2))
    total = ml.jit(lambda m: jax.tree.reduce(lambda a, b: a + b.sum(), m.tree.get_value(), 0.0))
    assert float(total(holder)) == 2.0
    holder.tree.set_value({"a": jnp.ones(3), "b": jnp.ones(4)})
    assert float(total(holder)) == 7.0


def test_jax_says_a_cache_miss_is_at_the_callers_line_and_argument(caplog):
    """As for jax.jit running the same call: the caller's line, and the argument by name."""

    def cache_miss(jit, first, second):
        caplog.clear()
        jit(first)
        line = inspect.currentframe().f_lineno + 2  # the call's line
        with jax.explain_cache_misses(True), caplog.at_level("WARNING"):
            jit(second)
        (message,) = (m for r in caplog.records if "TRACING CACHE MISS" in (m := r.getMessage()))
        return message, line

    def f(x):
        return x * 2

    theirs, their_line = cache_miss(jax.jit(f), jnp.ones(2), jnp.ones(2, jnp.int32))
    ours, our_line = cache_miss(ml.jit(f), jnp.ones(2), jnp.ones(2, jnp.int32))
    for message, line in ((theirs, their_line), (ours, our_line)):
        assert f"TRACING CACHE MISS at {__file__}:{line}" in message
        assert "* at x, now i32[2] and before f32[2]" in message

    def step(m, x):
        return m(x)

    layer, lifted = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), ml.jit(step)
    message, _ = cache_miss(lambda x: lifted(layer, x), jnp.ones((1, 2)), jnp.ones((1, 2), int))
    assert "* at x, now i32[1,2] and before f32[1,2]" in message


def test_output_spec_that_does_not_divide_the_output_is_named():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    double = ml.jit(lambda x: 2 * x, out_shardings=P("model"), mesh=mesh)
    with pytest.raises(
        ml.PlanError,
        match=r"`output` \(shape \(6,\)\) with out_shardings P\('model',\) on mesh "
        r"\{'data': 2, 'model': 4\}: dimension 0 \(size 6\)",
    ):
        double(jnp.ones((6,)))
    with pytest.raises(ml.PlanError, match=r"`output` \(shape \(6,\)\)"):
        double.lower(jnp.ones((6,)))
    with pytest.raises(ValueError, match="evenly divide"):  # the reference: jax.jit, no name
        jax.jit(lambda x: 2 * x, out_shardings=NamedSharding(mesh, P("model")))(jnp.ones((6,)))


def test_two_variables_holding_one_donated_array_are_named_and_left_alone():
    shared = jnp.ones((4,))
    model = nnx.Module()
    model.p, model.q = nnx.Param(shared), nnx.Param(shared)

    def step(m):
        m.p[...] = m.p[...] + 1
        m.q[...] = m.q[...] * 2

    with pytest.raises(ValueError, match=r"`m.p` and `m.q` hold the same array, and it is donated"):
        ml.jit(step, donate_argnums=0)(model)
    assert model.p.get_raw_value() is shared and model.q.get_raw_value() is shared
    assert not shared.is_deleted()
    # the reference: jax.jit refuses the same buffer donated twice, naming neither
    with pytest.raises(Exception, match="donate the same buffer twice"):
        jax.jit(lambda a, b: (a + 1, b * 2), donate_argnums=(0, 1))(shared, shared)
    # a donated array that a kept argument holds too
    single = nnx.Module()
    single.p = nnx.Param(shared)
    with pytest.raises(ValueError, match=r"`x` and `m.p` hold the same array"):
        ml.jit(lambda m, x: m.p[...] + x, donate_argnums=0)(single, shared)
    assert not shared.is_deleted()


def test_named_sharding_on_a_mesh_with_other_axes_is_checked_against_its_own_mesh():
    other = ml.make_mesh({"x": 8})
    layer = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
    forward = ml.jit(
        lambda m, x: m(x),
        in_shardings=({"kernel": NamedSharding(other, P(None, "x")), "bias": None}, P()),
        mesh=ml.make_mesh({"data": 2, "model": 4}),
    )
    with pytest.raises(
        ml.PlanError,
        match=r"`m.kernel` \(shape \(4, 6\)\) with in_shardings P\(None, 'x'\) on mesh "
        r"\{'x': 8\}: dimension 1 \(size 6\) is not divisible by 8",
    ):
        forward(layer, jnp.ones((2, 4)))
    # the reference: jax.jit refuses the same sharding for that shape, naming no argument
    with pytest.raises(ValueError, match="evenly divide"):
        jax.jit(lambda k: k, in_shardings=NamedSharding(other, P(None, "x")))(layer.kernel[...])


def test_argument_flattening_matches_jax_tree_flatten():
    # the per-call shortcut for top-level modules and arrays must give jax's own answer
    from meshlift.call.layout import flatten_arguments
    from meshlift.graph.split import is_graph_leaf

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    cases = [
        ((model, x), {}),
        ((x, model, x), {}),
        ((), {}),
        ((model, None), {}),
        ((model,), {"x": x}),
        (((model, x), [x]), {}),
        ((model, np.ones(2), 3.0), {}),
    ]

    def check(args, kwargs):
        leaves, treedef = flatten_arguments(args, kwargs)
        expected_leaves, expected = jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)
        assert treedef == expected
        assert len(leaves) == len(expected_leaves)
        assert all(a is b for a, b in zip(leaves, expected_leaves, strict=True))

    for args, kwargs in cases:
        check(args, kwargs)
    jax.jit(lambda x: check((model, x), {}) or x)(x)  # a tracer among the arguments


def test_each_call_runs_on_its_own_arguments_as_eager_does(plan_steps):
    # A call with the same argument types, nodes and mesh as the last skips the lookup:
    # every other sequence of calls must still find its own layout.
    import gc

    def forward(model, x):
        return model(sum(jax.tree.leaves(x)))

    lifted = ml.jit(forward)
    x = jnp.ones((1, 2))
    first, second = (nnx.Linear(2, 3, rngs=nnx.Rngs(seed)) for seed in (0, 1))
    calls = [
        (first, x),
        (first, x),  # the same again
        (second, x),  # another node
        (first, 2 * x),  # back, another array
        (first, np.ones((1, 2), np.float32)),  # another type of array
        (first, (x, 3 * x)),  # a tuple: another tree structure
        (first, x),
        (second, x),
    ]
    for model, arg in calls:
        np.testing.assert_allclose(lifted(model, arg), forward(model, arg), rtol=1e-6)
    for seed in range(3):  # a node collected, and new ones made, maybe at its address
        del first
        gc.collect()
        first = nnx.Linear(2, 3, rngs=nnx.Rngs(10 + seed))
        np.testing.assert_allclose(lifted(first, x), forward(first, x), rtol=1e-6)
        np.testing.assert_allclose(lifted(first, x), forward(first, x), rtol=1e-6)
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with ml.use_mesh(mesh):  # another mesh: its own layout
        out = lifted(first, x)
    np.testing.assert_allclose(out, forward(first, x), rtol=1e-6)
    assert out.sharding.mesh.shape == mesh.shape


# -- repeated calls: the plan ----------------------------------------------------------


@pytest.fixture(params=["C", "Python"])
def plan_steps(request, monkeypatch):
    """A repeated call's steps in C, and with the Python twins (installed without a compiler)."""
    if request.param == "Python":
        for name in (
            "read_each",
            "read_each_is",
            "write_each",
            "same_dicts",
            "plan_matches",
            "plan_inputs",
            "plan_write",
        ):
            monkeypatch.setattr(speedups, name, getattr(speedups, f"_{name}"))
    return request.param


class Counter(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(8.0))
        self.count = nnx.BatchStat(jnp.array(0))
        self.scale = 2.0


def update(model, x):
    model.w[...] = model.w[...] * model.scale + x
    model.count[...] += 1
    return model.w[...].sum()


def count_lookups(monkeypatch):
    """How many calls took the general path (a layout lookup) so far."""
    lookups = [0]
    general = Lifted._entry

    def counted(self, *args, **kwargs):
        lookups[0] += 1
        return general(self, *args, **kwargs)

    monkeypatch.setattr(Lifted, "_entry", counted)
    return lookups


def same_as_eager(lifted, model, twin, x):
    """Call `lifted` on `model` and the plain function on `twin`: the same output and state."""
    np.testing.assert_allclose(lifted(model, x), update(twin, x), rtol=1e-6)
    np.testing.assert_allclose(model.w[...], twin.w[...], rtol=1e-6)
    assert int(model.count[...]) == int(twin.count[...])


def test_repeated_calls_run_on_their_plan(plan_steps, monkeypatch):
    lookups = count_lookups(monkeypatch)
    lifted, model, twin = ml.jit(update), Counter(), Counter()
    for _ in range(4):
        same_as_eager(lifted, model, twin, jnp.float32(1))
    assert lookups[0] == 1  # only the first call looked its layout up
    assert lifted._plan is not None


def test_repeated_calls_follow_every_change_as_eager_does(plan_steps, monkeypatch):
    lookups = count_lookups(monkeypatch)
    lifted, model, twin = ml.jit(update), Counter(), Counter()
    mesh = ml.make_mesh({"data": 2, "model": 4})
    changes = [
        lambda m: None,
        lambda m: None,  # the plan
        lambda m: m.w.set_value(jnp.ones(8)),  # a new array: data, the same plan
        lambda m: setattr(m, "scale", 3.0),  # configuration changed in place: retraced
        lambda m: setattr(m, "w", nnx.Param(jnp.full(8, 2.0))),  # a new Variable
        lambda m: m.w.set_value(jnp.ones(4)),  # another shape: a layout for it, retraced
        lambda m: setattr(m, "extra", nnx.Param(jnp.zeros(2))),  # a new attribute
        lambda m: object.__setattr__(m, "__dict__", {**vars(m), "scale": 4.0}),  # swapped
        lambda m: None,
    ]
    for change in changes:
        change(model)
        change(twin)
        same_as_eager(lifted, model, twin, jnp.float32(0.5))
        same_as_eager(lifted, model, twin, jnp.ones((), jnp.float32))
    assert lookups[0] == 6  # the first call, the four structure changes and the new shape
    with ml.use_mesh(mesh):  # another mesh: its own layout
        same_as_eager(lifted, model, twin, jnp.float32(1))
        assert model.w[...].sharding.mesh.shape == mesh.shape
    same_as_eager(lifted, model, twin, jnp.float32(1))  # and back: looked up again
    assert lookups[0] == 8
    x = jnp.ones((2,), jnp.float32)  # another argument shape
    with pytest.raises(TypeError, match="incompatible shapes"):
        update(twin, x)  # 4 and 2 do not broadcast: eager refuses, and so does the lifted call
    before = np.asarray(model.w[...])
    with pytest.raises(TypeError, match="incompatible shapes"):
        lifted(model, x)
    np.testing.assert_array_equal(model.w[...], before)
    same_as_eager(lifted, model, twin, jnp.float32(1))


@dataclasses.dataclass
class Table:  # a static value: flax keeps it in the graph definition, not as data
    values: Any


class Tabled(nnx.Module):
    def __init__(self, values):
        self.w = nnx.Param(jnp.ones(2))
        self.table = Table(values)


# (make, change in place, read): containers a static value may hold, each changed in place
STATIC_CONTAINERS = {
    "deque": (lambda: collections.deque([1.0]), lambda t: t.append(2.0), sum),
    "bytearray": (lambda: bytearray(b"\x01"), lambda t: t.__setitem__(0, 3), lambda t: t[0]),
    "array.array": (lambda: array.array("d", [1.0]), lambda t: t.__setitem__(0, 4.0), max),
    "NumPy array": (lambda: np.ones(2), lambda t: t.__setitem__(0, 5.0), lambda t: t.sum()),
}


@pytest.mark.parametrize(
    ("make", "change", "read"), STATIC_CONTAINERS.values(), ids=STATIC_CONTAINERS
)
def test_a_static_container_changed_in_place_is_seen_as_eager_sees_it(
    plan_steps, make, change, read
):
    def scaled(model, x):
        return model.w[...] * x * float(read(model.table.values))

    lifted, model, twin = ml.jit(scaled), Tabled(make()), Tabled(make())
    for step in (lambda t: None, lambda t: None, change, lambda t: None):
        step(model.table.values)
        step(twin.table.values)
        np.testing.assert_allclose(lifted(model, jnp.float32(2)), scaled(twin, jnp.float32(2)))


def test_a_retrace_on_the_plan_that_returns_the_module_gives_the_module(plan_steps):
    def step(model, x):
        model.count[...] += 1
        return (model, x) if x.ndim else x

    lifted, model = ml.jit(step), Counter()
    lifted(model, jnp.float32(1))
    lifted(model, jnp.float32(1))  # the plan
    out, x = lifted(model, jnp.ones(2))  # retraced: the output holds the module now
    assert out is model
    assert int(model.count[...]) == 3
    np.testing.assert_array_equal(x, jnp.ones(2))


def test_a_repeated_call_under_an_outer_jit_writes_no_tracer(plan_steps):
    lifted, model = ml.jit(lambda m: update(m, jnp.float32(1))), Counter()
    lifted(model)
    lifted(model)  # the plan
    before = np.asarray(model.w[...])
    with pytest.raises(ml.TraceLeakError, match=r"m\.(w|count)"):
        jax.jit(lambda: lifted(model))()
    assert not isinstance(model.w.get_raw_value(), jax.core.Tracer)
    np.testing.assert_array_equal(model.w[...], before)
    assert int(model.count[...]) == 2
    lifted(model)  # and the plan still runs
    assert int(model.count[...]) == 3


def test_a_variable_moved_off_its_sharding_is_moved_back_on_a_repeated_call(plan_steps):
    mesh = ml.make_mesh({"data": 2, "model": 4})
    plan = ml.StateSharding({ml.path_endswith("w"): P("model"), ...: P()})
    lifted = ml.jit(update, mesh=mesh, in_shardings=(plan, P()))
    model, twin = Counter(), Counter()
    same_as_eager(lifted, model, twin, jnp.float32(1))
    same_as_eager(lifted, model, twin, jnp.float32(1))
    model.w.set_value(jax.device_put(model.w[...], NamedSharding(mesh, P("data"))))
    same_as_eager(lifted, model, twin, jnp.float32(1))
    assert model.w[...].sharding.spec == P("model")


def test_a_donating_step_runs_on_its_plan_and_refuses_a_shared_array(plan_steps, monkeypatch):
    lookups = count_lookups(monkeypatch)
    lifted, model, twin = ml.jit(update, donate_argnums=0), Counter(), Counter()
    model.extra, twin.extra = nnx.Param(jnp.zeros(8)), nnx.Param(jnp.zeros(8))
    for _ in range(3):
        old = model.w.get_raw_value()
        same_as_eager(lifted, model, twin, jnp.float32(1))
        assert old.is_deleted()  # donated, as under jax.jit
    assert lookups[0] == 1
    shared = model.w.get_raw_value()
    model.extra.set_value(shared)  # a new value, no new structure: two Variables, one array
    with pytest.raises(
        ValueError, match=r"`model.extra` and `model.w` hold the same array, and it is donated"
    ):
        lifted(model, jnp.float32(1))
    assert model.w.get_raw_value() is shared and not shared.is_deleted()
    model.extra.set_value(jnp.zeros(8))
    same_as_eager(lifted, model, twin, jnp.float32(1))


def test_a_step_that_writes_a_typed_key_back_runs_the_general_way(plan_steps):
    class Keyed(nnx.Module):
        def __init__(self):
            self.key = nnx.Variable(jax.random.key(0))

    def advance(m):
        m.key[...], sub = jax.random.split(m.key[...])
        return jax.random.uniform(sub)

    lifted, model, twin = ml.jit(advance), Keyed(), Keyed()
    for _ in range(3):
        np.testing.assert_array_equal(lifted(model), advance(twin))
        np.testing.assert_array_equal(
            jax.random.key_data(model.key[...]), jax.random.key_data(twin.key[...])
        )
    # a typed key is no plain array: the plan could not write it, so it only skips the lookup
    assert lifted._plan is not None and lifted._plan.slot is None
