"""The engine's correctness contract, each case against its reference (eager or nnx.jit).

Static values changed in place between calls, where modules sit among the
arguments, a failed first call with a plan, sow through a lifted method, and
staging errors that name the backend.
"""

import collections
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.testing.models import graph_mode_jit


class Cfg:
    def __init__(self):
        self.scale = 2.0


class Slotted:
    __slots__ = ("scale",)

    def __init__(self):
        self.scale = 2.0


@dataclasses.dataclass(slots=True)
class SlotsDataclass:
    scale: float = 2.0


class ScaleList(list):
    pass


def _set_attr(cfg, value):
    cfg.scale = value


def _set_item(cfg, value):
    cfg["scale"] = value


def _set_first(cfg, value):
    cfg[0] = value


def _replace_set(cfg, value):
    cfg.clear()
    cfg.add(value)


def _set_keyword(cfg, value):
    cfg.keywords["scale"] = value


def _read_attr(cfg):
    return cfg.scale


def _read_item(cfg):
    return cfg["scale"]


def _read_first(cfg):
    return cfg[0]


def _read_set(cfg):
    return next(iter(cfg))


def _read_keyword(cfg):
    return cfg.keywords["scale"]


STATICS = {
    "object": (Cfg, _set_attr, _read_attr),
    "SimpleNamespace": (lambda: types.SimpleNamespace(scale=2.0), _set_attr, _read_attr),
    "__slots__": (Slotted, _set_attr, _read_attr),
    "dataclass(slots=True)": (SlotsDataclass, _set_attr, _read_attr),
    "OrderedDict": (lambda: collections.OrderedDict(scale=2.0), _set_item, _read_item),
    "defaultdict": (
        lambda: collections.defaultdict(float, scale=2.0),
        _set_item,
        _read_item,
    ),
    "list subclass": (lambda: ScaleList([2.0]), _set_first, _read_first),
    "set": (lambda: {2.0}, _replace_set, _read_set),
    "partial.keywords": (lambda: functools.partial(max, scale=2.0), _set_keyword, _read_keyword),
}


@pytest.mark.parametrize("kind", list(STATICS))
def test_static_value_changed_in_place_between_calls_retraces(kind):
    make, change, read = STATICS[kind]

    class Scaled(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))
            self.cfg = make()

        def __call__(self):
            return self.w[...] * read(self.cfg)

    model = Scaled()
    forward = ml.jit(lambda m: m())
    np.testing.assert_array_equal(forward(model), model())
    change(model.cfg, 5.0)
    np.testing.assert_array_equal(forward(model), model())  # eager is the reference: 5.0
    np.testing.assert_array_equal(forward(model), np.full(3, 5.0))


def test_module_position_among_the_arguments_is_part_of_the_layout():
    lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    f = ml.jit(
        lambda a, b: (a if isinstance(a, nnx.Module) else b)(b if isinstance(a, nnx.Module) else a)
    )
    np.testing.assert_allclose(f(lin, x), lin(x), atol=1e-6)
    np.testing.assert_allclose(f(x, lin), lin(x), atol=1e-6)


def test_failed_first_call_with_a_plan_leaves_the_callers_arrays_as_they_were():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    kernel = model.kernel.get_raw_value()
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})

    def fails(m):
        m.kernel[...] += 1
        raise ValueError("raised inside")

    with pytest.raises(ValueError, match="raised inside"):
        ml.jit(fails, in_shardings=(plan,), mesh=mesh)(model)
    assert model.kernel.get_raw_value() is kernel  # the very same array object


def test_placement_happens_once_a_call_has_succeeded():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    ml.jit(lambda m: m(jnp.ones((1, 8))), in_shardings=(plan,), mesh=mesh)(model)
    assert model.kernel[...].sharding.spec == P(None, "model")


def test_sow_through_a_lifted_method_is_carried_back_as_under_nnx_jit():
    class Block(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            y = self.lin(x)
            self.sow(nnx.Intermediate, "hidden", y)
            return y

    x = jnp.ones((1, 3))
    model, reference = Block(), Block()
    ml.jit(lambda m, x: m(x))(model, x)
    graph_mode_jit(lambda m, x: m(x))(reference, x)
    np.testing.assert_allclose(
        model.hidden.get_value()[0], reference.hidden.get_value()[0], atol=1e-6
    )


def test_staging_error_names_the_backend_and_its_origin():
    def stage(fn, spec):
        raise RuntimeError("cannot stage this")

    backend = ml.Backend(name="broken", stage=stage)
    with pytest.raises(RuntimeError, match="cannot stage this") as info:
        ml.transform(backend, lambda x: x)(jnp.ones(2))
    assert "backend 'broken' (registered in this process)" in "\n".join(info.value.__notes__)


def test_a_stage_that_returns_nothing_names_the_backend():
    backend = ml.Backend(name="forgetful", stage=lambda fn, spec: None)
    with pytest.raises(TypeError) as info:
        ml.transform(backend, lambda x: x)(jnp.ones(2))
    assert str(info.value) == (
        "backend 'forgetful' (registered in this process) staged <lambda> as NoneType None: "
        "its stage(fn, spec) must return the staged callable, such as jax.jit(fn, ...); did "
        "it forget to return it?"
    )


def test_stages_a_backend_lacks_name_the_backend():
    def stage(fn, spec):
        jitted = jax.jit(fn)
        return lambda *args: jitted(*args)  # callable, but no trace / lower

    f = ml.transform(ml.Backend(name="bare", stage=stage), lambda x: 2 * x)
    assert f(jnp.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(
        AttributeError,
        match=r"backend 'bare' \(registered in this process\) "
        r"staged <lambda> as function, which has no \.lower\(\)",
    ):
        f.lower(jnp.ones(2))


def test_an_error_raised_while_the_backend_runs_the_function_names_the_backend():
    backend = ml.Backend(name="plain", stage=lambda fn, spec: jax.jit(fn))

    def bad(x):
        return x.reshape(3)

    with pytest.raises(TypeError, match="cannot reshape") as info:
        ml.transform(backend, bad)(jnp.ones(2))
    assert "raised while backend 'plain' (registered in this process) ran bad" in (
        info.value.__notes__
    )
    with pytest.raises(TypeError) as info:
        ml.jit(bad)(jnp.ones(2))
    assert f"raised while backend 'jit' (meshlift-jit {ml.get_backend('jit').version}) ran bad" in (
        info.value.__notes__
    )


def test_a_misspelt_capability_names_the_backend_and_the_close_match():
    with pytest.raises(ValueError) as info:
        ml.Backend(name="mine", stage=jax.jit, capabilities={"stages", "donate"})
    assert str(info.value).startswith(
        "Backend 'mine' claims the capability 'donate', which meshlift does not know; did you "
        "mean 'donation'? The capabilities are: auto-partitioning, manual-collectives,"
    )


def test_capabilities_given_as_one_string_is_a_type_error():
    with pytest.raises(TypeError, match=r"got the string 'stages': write \{'stages'\}"):
        ml.Backend(name="mine", stage=jax.jit, capabilities="stages")


def test_graph_node_given_as_a_spec_is_refused_when_lifting():
    with pytest.raises(ml.PlanError, match="graph node, where specs go"):
        ml.jit(lambda m: m, in_shardings=(nnx.Dict(a=P()),))


def test_update_under_outer_grad_and_scan_raises_and_leaves_no_tracer():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    before = np.asarray(model.kernel[...])

    def bump(m, x):
        m.kernel[...] = m.kernel[...] + x
        return jnp.sum(m.kernel[...])

    step = ml.jit(bump)
    with pytest.raises(ml.TraceLeakError, match=r"m\.kernel"):
        jax.grad(lambda x: step(model, x))(1.0)
    with pytest.raises(ml.TraceLeakError, match=r"m\.kernel"):
        jax.lax.scan(lambda c, x: (c + step(model, x), None), 0.0, jnp.ones(2))
    assert not isinstance(model.kernel.get_raw_value(), jax.core.Tracer)
    np.testing.assert_array_equal(model.kernel[...], before)


def test_read_only_function_under_an_outer_jit_works():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    forward = ml.jit(lambda m, x: m(x))
    np.testing.assert_allclose(jax.jit(lambda x: forward(model, x))(x), model(x), atol=1e-6)


def test_capture_through_a_lifted_method_matches_nnx_jit():
    def block(decorate):
        class Block(nnx.Module):
            def __init__(self):
                self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

            @decorate
            def __call__(self, x):
                y = self.lin(x)
                self.sow(nnx.Intermediate, "h", y)
                return y

        return Block()

    x = jnp.ones((1, 3))
    _, ours = nnx.capture(block(ml.jit), nnx.Intermediate)(x)
    _, reference = nnx.capture(block(nnx.jit), nnx.Intermediate)(x)
    assert jax.tree.structure(ours) == jax.tree.structure(reference)
    np.testing.assert_allclose(ours["h"].get_value()[0], reference["h"].get_value()[0], atol=1e-6)


class _Counted(nnx.Module):
    def __init__(self, mesh):
        sharding = None if mesh is None else jax.NamedSharding(mesh, P("data", "model"))
        self.w = nnx.Param(jax.device_put(jnp.ones((8, 4)), sharding))
        self.b = nnx.Param(jax.device_put(jnp.zeros((8, 4)), sharding))


def _fails_on_the_host(m):
    m.w[...] += 1
    jax.debug.callback(lambda w: 1 / 0, m.w[...], partitioned=True)  # on every device
    return m.w[...]


def _what_the_caller_holds(model, before):
    """Per Variable: kept (the same array), deleted, new, or poisoned (reading raises)."""
    held = {}
    for name, old in before.items():
        array = getattr(model, name).get_raw_value()
        if array is old:
            held[name] = "deleted" if old.is_deleted() else "kept"
            continue
        try:
            array.block_until_ready()
            held[name] = "new"
        except jax.errors.JaxRuntimeError:
            held[name] = "poisoned"
    return held


def _call_and_hold(lifted, mesh):
    model = _Counted(mesh)
    before = {"w": model.w.get_raw_value(), "b": model.b.get_raw_value()}
    try:
        lifted(model)
        raised = False
    except jax.errors.JaxRuntimeError as error:
        raised = ("".join(getattr(error, "__notes__", [])), True)
    held = _what_the_caller_holds(model, before)
    _settle_runtime_tokens()
    return raised, held


def _settle_runtime_tokens():
    """JAX re-raises a failed callback at every effects barrier (and at exit) until a
    computation with callbacks succeeds on the same devices: run one on all of them."""
    n = jax.device_count()
    everywhere = jax.NamedSharding(jax.make_mesh((n,), ("all",)), P("all"))
    quiet = jax.jit(lambda a: jax.debug.callback(lambda a: None, a, partitioned=True))
    quiet(jax.device_put(jnp.zeros(n), everywhere))
    jax.effects_barrier()


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("on_mesh", [False, True], ids=["one-device", "mesh-2x4"])
def test_error_after_dispatch_leaves_the_caller_what_nnx_jit_leaves(on_mesh, donate):
    mesh = ml.make_mesh({"data": 2, "model": 4}) if on_mesh else None
    options = {"donate_argnums": 0} if donate else {}
    plan = {"in_shardings": (ml.StateSharding({...: P("data", "model")}),), "mesh": mesh}
    ours = _call_and_hold(ml.jit(_fails_on_the_host, **options, **(plan if on_mesh else {})), mesh)
    reference = _call_and_hold(graph_mode_jit(_fails_on_the_host, **options), mesh)
    raised, held = ours
    assert bool(raised) == bool(reference[0])
    for name, state in held.items():  # as nnx.jit, or better: an untouched array is kept
        assert state == reference[1][name] or (state, reference[1][name]) == ("kept", "poisoned")
    if raised:  # the error surfaced at the call: nothing was written
        assert held == {"w": "deleted", "b": "deleted"} if donate else {"w": "kept", "b": "kept"}
        assert all(f"`m.{name}`" in raised[0] for name in "wb") is donate
    else:  # it surfaced on the results: the written arrays carry it
        assert held["w"] == "poisoned"
        assert held["b"] == ("poisoned" if donate else "kept")


class _Counted2(nnx.Module):
    """A counter that does not depend on the input, a weight that does, an array on the module."""

    def __init__(self):
        self.count = nnx.BatchStat(jnp.zeros(()))
        self.w = nnx.Param(jnp.ones(8))
        self.z = nnx.data(jnp.ones(8))


def _step_with_counter(m, x):
    m.count[...] += 1  # concrete under an outer grad: only w's value is a tracer
    m.w[...] = m.w[...] * x
    return m.w[...].sum()


def _step_on_data(m, x):
    m.z = m.z * x
    return m.z.sum()


@pytest.mark.parametrize("outer", ["grad", "vmap"])
@pytest.mark.parametrize("step", [_step_with_counter, _step_on_data], ids=["mixed", "nnx.data"])
def test_outer_transform_with_some_values_traced_writes_no_tracer(outer, step):
    model = _Counted2()
    before = {name: getattr(model, name) for name in ("count", "w", "z")}
    before = {k: v.get_raw_value() if isinstance(v, nnx.Variable) else v for k, v in before.items()}
    lifted = ml.jit(step)
    with pytest.raises(ml.TraceLeakError, match=r"`m\.(w|z)`"):
        if outer == "grad":
            jax.grad(lambda x: lifted(model, x))(2.0)
        else:
            jax.vmap(lambda x: lifted(model, x))(jnp.arange(2.0))
    assert model.count.get_raw_value() is before["count"]  # nothing written
    assert model.w.get_raw_value() is before["w"]
    assert model.z is before["z"]


@pytest.mark.parametrize("how", ["donated", "placed by a plan"])
def test_array_stored_on_a_module_is_written_back_as_under_nnx_jit(how):
    def step(m):
        m.w[...] += 1
        return m.w[...].sum() + m.z.sum()

    if how == "donated":
        ours, options = ml.jit(step, donate_argnums=0), {"donate_argnums": 0}
    else:
        plan = ml.StateSharding({ml.path_endswith("z"): P("data"), ...: P()})
        mesh = ml.make_mesh({"data": 8})
        ours, options = ml.jit(step, in_shardings=(plan,), mesh=mesh), {}
    model, reference = _Counted2(), _Counted2()
    for _ in range(2):
        np.testing.assert_array_equal(ours(model), graph_mode_jit(step, **options)(reference))
    for name in ("w", "z"):
        mine, theirs = getattr(model, name), getattr(reference, name)
        np.testing.assert_array_equal(
            mine.get_raw_value() if name == "w" else mine,
            theirs.get_raw_value() if name == "w" else theirs,
        )
    assert not model.z.is_deleted()
    if how == "placed by a plan":
        assert model.z.sharding.spec == P("data")


def test_output_plan_with_a_module_added_inside_is_resolved():
    mesh = ml.make_mesh({"data": 2, "model": 4})

    def grow(m):
        m.extra = nnx.Linear(8, 8, rngs=nnx.Rngs(1))
        return m.extra

    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    model, reference = nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    lifted = ml.jit(grow, out_shardings=plan, mesh=mesh)
    abstract = lifted.eval_shape(model)
    assert abstract.kernel.get_value().shape == (8, 8)
    out = lifted(model)
    expected = grow(reference)  # eager is the reference
    assert out is model.extra
    np.testing.assert_array_equal(out.kernel[...], expected.kernel[...])
