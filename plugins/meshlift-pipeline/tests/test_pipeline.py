"""The pipeline backend against the same model run as a plain scan, on one device.

The model is eight residual blocks made by `nnx.vmap` (a `layers` axis) and run
with `ml.scan_layers`; the reference is `nnx.jit` of the same train step on one
device, where `ml.scan_layers` is `jax.lax.scan`. Each pipelined run must give its
losses, its gradients and its parameters after three Adam steps (f32, rtol 1e-5),
its loop must be `M * R + S - 1` stage steps long, and each device must hold `1/S`
of the stack.
"""

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.layers import running
from meshlift_pipeline import Schedule, pipeline

LAYERS, WIDTH, BATCH, STEPS = 8, 16, 24, 3
RULES = [("layers", "stage"), ("embed", "data"), ("mlp", "model")]


class Block(nnx.Module):
    def __init__(self, rngs):
        init = ml.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        bias = ml.with_partitioning(nnx.initializers.zeros_init(), ("mlp",))
        self.linear = nnx.Linear(WIDTH, WIDTH, kernel_init=init, bias_init=bias, rngs=rngs)
        self.scale = nnx.Param(ml.with_partitioning(jnp.ones, ("mlp",))((WIDTH,)))

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x)) * self.scale[...]


class Stack(nnx.Module):
    def __init__(self, rngs, block=Block):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs):
            return block(rngs)

        self.blocks = blocks(rngs)

    def __call__(self, x):
        y, _ = ml.scan_layers(lambda x, block: (block(x), None), x, self.blocks)
        return y


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss, grads


def batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    return x, jnp.sin(x)


def run(step, model, optimizer):
    x, y = batch()
    out = [step(model, optimizer, x, y) for _ in range(STEPS)]
    losses = [float(loss) for loss, _ in out]
    return losses, nnx.to_pure_dict(out[0][1]), nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.cache
def reference():
    """The same step under nnx.jit on one device: `ml.scan_layers` is a plain scan."""
    model = Stack(nnx.Rngs(0))
    return run(nnx.jit(train_step), model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))


def pipelined(shape, microbatches, repeats, axis_types=AxisType.Auto):
    mesh = ml.make_mesh(
        dict(zip(("stage", "data", "model"), shape, strict=True)), axis_types=(axis_types,) * 3
    )
    with ml.use_mesh(mesh), ml.axis_rules(RULES):
        model = Stack(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    step = pipeline(
        train_step,
        microbatches=microbatches,
        repeats=repeats,
        in_shardings=(plan, plan, P("data"), P("data")),
        mesh=mesh,
    )
    return step, model, optimizer, mesh


def assert_trees_close(got, want, what):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{what} {path}")


# (stage, data, model), microbatches, repeats, mesh axis types: 2, 4 and 8 stages;
# GPipe and circular; microbatch counts that are multiples of the stage count and that
# are not; Auto axes and Explicit ones (sharding in types, jax.make_mesh's default)
SCHEDULES = [
    ((2, 2, 2), 4, 1, AxisType.Auto),
    ((2, 2, 2), 3, 1, AxisType.Auto),
    ((2, 2, 2), 4, 2, AxisType.Auto),
    ((2, 2, 2), 4, 2, AxisType.Explicit),
    ((4, 2, 1), 6, 2, AxisType.Auto),
    ((4, 1, 2), 2, 1, AxisType.Explicit),
    ((8, 1, 1), 8, 1, AxisType.Auto),
    ((8, 1, 1), 3, 1, AxisType.Auto),
]


@pytest.mark.parametrize(
    ("shape", "microbatches", "repeats", "axis_types"),
    SCHEDULES,
    ids=[f"{'x'.join(map(str, s))}-M{m}-R{r}-{t.name}" for s, m, r, t in SCHEDULES],
)
def test_losses_gradients_and_steps_equal_the_plain_scan(shape, microbatches, repeats, axis_types):
    step, model, optimizer, _mesh = pipelined(shape, microbatches, repeats, axis_types)
    losses, grads, params = run(step, model, optimizer)
    ref_losses, ref_grads, ref_params = reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(grads, ref_grads, "gradient of")
    assert_trees_close(params, ref_params, f"after {STEPS} steps,")
    kernel = model.blocks.linear.kernel[...]
    assert kernel.sharding.spec == P("stage", "data", "model")
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {LAYERS // shape[0]}


def scan_lengths(jaxpr) -> list[int]:
    """The length of every scan in `jaxpr`, outermost first, nested ones included."""
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            lengths.extend(scan_lengths(sub))
    return lengths


@pytest.mark.parametrize(("stages", "microbatches", "repeats"), [(4, 4, 1), (2, 4, 2), (8, 3, 1)])
def test_the_loop_runs_m_times_r_plus_s_minus_1_stage_steps(stages, microbatches, repeats):
    mesh = ml.make_mesh({"stage": stages}, devices=jax.devices()[:stages])
    schedule = Schedule(mesh, "stage", microbatches, repeats)
    x, _ = batch()
    weights = jnp.ones((LAYERS, WIDTH, WIDTH)) / WIDTH

    def forward(weights, x):
        with running(schedule.scan):
            y, _ = ml.scan_layers(lambda x, w: (jnp.tanh(x @ w), None), x, weights)
        return jnp.sum(y)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(forward))(weights, x).jaxpr
    per_stage = LAYERS // (stages * repeats)
    loop = microbatches * repeats + stages - 1
    # the forward loop and its transpose, each over the stage steps, each stage step a
    # scan over the stage's layers
    assert schedule.steps() == loop
    assert sorted(set(scan_lengths(jaxpr))) == sorted({loop, per_stage})
    assert scan_lengths(jaxpr).count(loop) == 2


def test_each_device_holds_one_stage_of_the_stack():
    step, model, optimizer, _mesh = pipelined((8, 1, 1), 8, 1)
    x, y = batch()
    step(model, optimizer, x, y)  # the stack and Adam's state, as the plan lays them out
    compiled = step.lower(model, optimizer, x, y).compile()
    stack = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model.blocks)))
    # per device: 1/8 of the stack, of Adam's two moments of it; the whole batch (no
    # `data` axis) and two int32 counts (Adam's and the optimizer's)
    arguments = compiled.memory_analysis().argument_size_in_bytes
    assert arguments == 3 * stack // 8 + x.nbytes + y.nbytes + 2 * 4
    for leaf in jax.tree.leaves(nnx.state(model.blocks)):
        assert all(s.data.nbytes == leaf.nbytes // 8 for s in leaf.addressable_shards)


def test_a_mesh_without_the_stage_axis_runs_the_stack_as_one_stage():
    step, model, optimizer, mesh = pipelined((1, 2, 4), 4, 1)
    assert "stage" in mesh.axis_names
    losses, _grads, _params = run(step, model, optimizer)
    np.testing.assert_allclose(losses, reference()[0], rtol=1e-5)
    assert Schedule(ml.make_mesh({"data": 8}), "stage", 4).stages == 1
    assert Schedule(mesh, "stage").microbatches == 1  # by default, one per stage
    with (
        pytest.raises(ValueError, match="mesh axis 'stage' of no mesh"),
        running(Schedule(None, "stage", 4, repeats=3).scan),
    ):
        ml.scan_layers(lambda x, w: (x @ w, None), jnp.ones((4, 3)), jnp.ones((8, 3, 3)))


@pytest.mark.parametrize(
    ("shape", "microbatches", "repeats", "message"),
    [
        (
            (2, 2, 2),
            5,
            1,
            "into 5 microbatches; the carry's leading sizes are ['24'] (shapes (24, 16))",
        ),
        (
            (8, 1, 1),
            8,
            2,
            "8 layers (the stack's shapes (8, 16), (8, 16, 16), (8, 16)) do not split into 8 stages (mesh axis 'stage' of mesh {'stage': 8, 'data': 1, 'model': 1}) x 2 repeats",
        ),
        ((4, 2, 1), 2, 2, "needs at least as many microbatches as stages: 2 microbatches"),
    ],
)
def test_a_stack_that_does_not_split_is_a_value_error_saying_why(
    shape, microbatches, repeats, message
):
    step, model, optimizer, _mesh = pipelined(shape, microbatches, repeats)
    before = nnx.to_pure_dict(nnx.state(model))
    with pytest.raises(ValueError, match=re.escape(message)):
        step(model, optimizer, *batch())
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), before, "unchanged")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"microbatches": 0}, ValueError, "microbatches must be a positive int, got 0"),
        ({"microbatches": 2, "repeats": 1.5}, ValueError, "repeats must be a positive int"),
        ({"microbatches": 2, "stage_axis": 0}, TypeError, "stage_axis is a mesh axis name"),
    ],
)
def test_options_are_checked_when_the_function_is_lifted(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ml.transform("pipeline", train_step, **options)


def test_per_layer_outputs_are_refused_by_name():
    schedule = Schedule(ml.make_mesh({"stage": 2}, devices=jax.devices()[:2]), "stage", 2)

    def forward(w, x):
        with running(schedule.scan):
            return ml.scan_layers(lambda x, w: (x @ w, x), x, w)

    with pytest.raises(ValueError, match=r"returns \(carry, None\)"):
        jax.eval_shape(forward, jnp.ones((4, 3, 3)), jnp.ones((4, 3)))


class NoisyBlock(Block):
    """A block that changes Variables as it runs: a counter, and its dropout stream's count."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.calls = nnx.BatchStat(jnp.zeros(()))
        self.dropout = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        self.calls[...] += 1
        return self.dropout(super().__call__(x))


def test_variables_the_layers_change_follow_each_microbatch_as_run_one_after_another():
    """Under the pipeline each layer sees the microbatches in order, its counter and its
    dropout stream moving once per microbatch: the same as running the unpipelined stack
    on each microbatch in turn (the reference, nnx.jit on one device)."""
    microbatches = 4

    def sequential_step(model, optimizer, x, y):
        def loss(model):
            parts = zip(jnp.split(x, microbatches), jnp.split(y, microbatches), strict=True)
            return jnp.mean(jnp.stack([jnp.mean((model(a) - b) ** 2) for a, b in parts]))

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value, grads

    model = Stack(nnx.Rngs(0, dropout=1), NoisyBlock)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    want = run(nnx.jit(sequential_step), model, optimizer)

    mesh = ml.make_mesh({"stage": 4, "data": 2, "model": 1})
    with ml.use_mesh(mesh), ml.axis_rules(RULES):
        piped = Stack(nnx.Rngs(0, dropout=1), NoisyBlock)
        piped_optimizer = nnx.Optimizer(piped, optax.adam(1e-2), wrt=nnx.Param)
        plan = ml.StateSharding.from_metadata(piped, mesh=mesh)
    step = pipeline(
        train_step,
        microbatches=microbatches,
        in_shardings=(plan, plan, P("data"), P("data")),
        mesh=mesh,
    )
    got = run(step, piped, piped_optimizer)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_trees_close(got[2], want[2], f"after {STEPS} steps,")
    assert piped.blocks.calls[...].tolist() == [STEPS * microbatches] * LAYERS
    counts = piped.blocks.dropout.rngs.count[...]
    np.testing.assert_array_equal(counts, model.blocks.dropout.rngs.count[...])
    assert counts.tolist() == [STEPS * microbatches] * LAYERS
