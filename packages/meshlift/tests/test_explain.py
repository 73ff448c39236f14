"""ml.explain: a row per parameter, every problem with its path, and nothing compiled."""

import contextlib
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import monitoring
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

MESH = {"data": 2, "model": 4}


class Odd(nnx.Module):
    """linear2's kernel has 30 rows: not divisible by the 4 devices of 'model'."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(
            16, 30, kernel_init=ml.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.linear2 = nnx.Linear(
            30, 16, kernel_init=ml.with_partitioning(init, ("model", None)), rngs=rngs
        )


@contextlib.contextmanager
def compile_events():
    """Record JAX's tracing/lowering/compiling events (jax.monitoring) made inside the block."""
    events = []

    def on_duration(event, duration, **kwargs):
        events.append(event)

    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(on_duration)


def test_the_compile_counter_sees_a_compile():  # the positive control for the check below
    with compile_events() as events:
        jax.jit(lambda x: x * 7 + 1)(jnp.ones(5))
    assert "/jax/core/compile/backend_compile_duration" in events


def test_non_divisible_dimension_is_listed_by_path_without_compiling():
    model = Odd(nnx.Rngs(0))
    with compile_events() as events:
        report = ml.explain(model, None, MESH)
        text = str(report)
    assert not any("compile" in e or "trace" in e for e in events), events
    assert not report.ok
    paths = [path for path, _ in report.problems]
    assert paths == ["linear1.kernel", "linear2.kernel"]
    assert "linear2.kernel" in text and "not divisible by 4" in text
    with pytest.raises(ml.PlanError, match=r"`linear1\.kernel` \(shape \(16, 30\)"):
        report.check()


def test_rows_totals_and_every_problem_listed():
    plan = ml.StateSharding(
        {
            ml.path_endswith("linear1", "kernel"): P("expert", "model"),  # unknown axis
            ml.path_endswith("linear2", "kernel"): P("model", "model"),  # used twice
            ml.path_endswith("linear1", "bias"): P(None, "data"),  # longer than rank
            ml.path_endswith("nothing", "here"): P("data"),  # matches nothing
            ...: P(),
        }
    )
    abstract = nnx.eval_shape(lambda: Odd(nnx.Rngs(0)))
    report = ml.explain(abstract, plan, MESH)
    problems = {
        path: " | ".join(p for q, p in report.problems if q == path) for path, _ in report.problems
    }
    assert "'expert' is not in the mesh" in problems["linear1.kernel"]
    assert "not divisible by 4" in problems["linear1.kernel"]  # every problem, not the first
    assert "'model' is used twice" in problems["linear2.kernel"]
    assert "rank 1" in problems["linear1.bias"]
    assert any(
        "path_endswith('nothing', 'here')" in w and "matched no parameter" in w
        for w in report.warnings
    )
    assert len(report.rows) == 4
    assert report.total_bytes == (16 * 30 + 30 + 30 * 16 + 16) * 4


def test_good_plan_bytes_per_device_and_replicated_warning():
    tree = {
        "emb": nn.Partitioned(jax.ShapeDtypeStruct((1024, 512), jnp.float32), ("data", "model")),
        "big": jax.ShapeDtypeStruct((512, 1024), jnp.float32),
    }
    report = ml.explain(tree, None, MESH)
    assert report.ok
    rows = {r.path: r for r in report.rows}
    assert rows["emb"].shards == 8 and rows["emb"].bytes_per_device == 1024 * 512 * 4 // 8
    assert rows["big"].shards == 1
    assert any("`big`" in w and "replicated" in w for w in report.warnings)
    assert report.bytes_per_device == 1024 * 512 * 4 // 8 + 512 * 1024 * 4
    text = str(report)
    assert "total per device: 2.2 MiB of 4.0 MiB unsharded" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert {r["path"]: r["spec"] for r in data["rows"]} == {"big": [], "emb": ["data", "model"]}


def test_logical_annotations_explained_with_rules_or_flagged_without():
    tree = {
        "w": nn.LogicallyPartitioned(
            jax.ShapeDtypeStruct((8, 16), jnp.float32), ("embed", "hidden")
        )
    }
    assert ml.explain(tree, [("hidden", "model")], MESH).rows[0].spec == P(None, "model")
    with ml.axis_rules([("embed", "data")]):
        assert ml.explain(tree, None, MESH).rows[0].spec == P("data", None)
    report = ml.explain(tree, None, MESH)
    assert "no axis rules are set" in dict(report.problems)["w"]


def test_missing_rules_advice_names_the_arrays_own_logical_names():
    tree = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 16), jnp.float32), ("a", "b"))}
    problem = dict(ml.explain(tree, None, {"data": 2, "model": 4}).problems)["w"]
    assert "e.g. [('b', 'model')], or use ml.axis_rules" in problem


def test_explain_needs_a_mesh():
    with pytest.raises(TypeError, match="explain needs a mesh"):
        ml.explain({"a": jnp.ones(2)})


def test_a_parameter_no_filter_matches_is_the_error_a_call_raises():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model")})  # no `...`
    report = ml.explain(layer, plan, mesh)
    with pytest.raises(ml.PlanError) as call:
        ml.jit(lambda m: m.kernel[...].sum(), in_shardings=(plan,), mesh=mesh)(layer)
    assert report.problems == [("bias", str(call.value))]  # the same lookup, the same words
    assert "no filter of the plan matches `bias` (Param, shape (8,))" in str(call.value)


def test_a_named_sharding_on_another_mesh_is_placed_as_a_call_places_it():
    mesh, flat = ml.make_mesh({"data": 2, "model": 4}), ml.make_mesh({"x": 8})
    layer = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): NamedSharding(flat, P("x")), ...: P()})
    step = ml.jit(lambda m: m.kernel[...].sum(), in_shardings=(plan,), mesh=mesh)
    step(layer)  # runs: JAX places the kernel on its own mesh
    placed = jax.jit(lambda k: k, in_shardings=NamedSharding(flat, P("x")))(layer.kernel[...])
    report = ml.explain(layer, plan, mesh)
    assert report.ok  # no problem a call does not have
    kernel = report.row("kernel")
    assert kernel.shards == 8
    assert kernel.bytes_per_device == placed.addressable_shards[0].data.nbytes
    assert report.warnings[0] == "`kernel` is placed on its NamedSharding's mesh, {'x': 8}"
    assert report.layout("kernel").grid() == [[str(i)] for i in range(8)]


def test_a_model_with_an_rng_stream_and_integer_state_is_explained():
    """Every dtype a Variable holds: an RNG key (JAX's extended dtype), its counter, ints."""

    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    model = Noisy(nnx.Rngs(0, dropout=1))
    report = ml.explain(model, ml.StateSharding({...: P()}), MESH)
    rows = {r.path: r for r in report.rows}
    key = model.dropout.rngs.key[...]
    assert (rows["dropout.rngs.key"].dtype, rows["dropout.rngs.key"].bytes) == (
        str(key.dtype),
        key.dtype.itemsize,
    )
    assert (rows["calls"].dtype, rows["calls"].bytes) == ("int32", 4)
    assert not report.problems
