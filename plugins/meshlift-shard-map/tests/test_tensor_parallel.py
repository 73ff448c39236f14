"""A 4-layer width-1024 tensor-parallel MLP on a 2x4 mesh: numbers and collectives.

``ml.shard_map`` (explicit ``psum``) and ``ml.jit`` (the compiler's collectives)
run 5 SGD steps with the same plan and must agree with each other and with a
single-device run; the compiled ``ml.shard_map`` step must hold the same
collectives as the step written by hand with ``jax.shard_map`` over arrays.
Each program compiles once (width 1024 is slow to compile on 2 cores).
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

WIDTH, BATCH, STEPS, LR = 1024, 8, 5, 0.1
LAYERS = ("up1", "down1", "up2", "down2")  # column, row, column, row parallel


def column(x, kernel, bias):
    return jax.nn.relu(x @ kernel + bias)


def row(h, kernel, bias, reduce):
    return reduce(h @ kernel) + bias  # the bias once, after the partial sums are added


def identity(y):
    return y


def psum_model(y):
    return jax.lax.psum(y, "model")


class TPMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        for name in LAYERS:
            setattr(self, name, nnx.Linear(WIDTH, WIDTH, rngs=rngs))

    def __call__(self, x, reduce=identity):
        for up, down in ((self.up1, self.down1), (self.up2, self.down2)):
            h = column(x, up.kernel[...], up.bias[...])
            x = row(h, down.kernel[...], down.bias[...], reduce)
        return x


COLUMN = {"kernel": P(None, "model"), "bias": P("model")}
ROW = {"kernel": P("model", None), "bias": P()}
SPECS = {"up1": COLUMN, "down1": ROW, "up2": COLUMN, "down2": ROW}
PLAN = ml.StateSharding.from_state(SPECS)  # the same specs as the hand-written step's


def make_step(manual: bool):
    """One SGD step; per shard (``manual``) it psums over 'model' and averages over 'data'."""

    def step(model, x, y):
        def loss_fn(model):
            loss = jnp.mean((model(x, psum_model if manual else identity) - y) ** 2)
            return jax.lax.pmean(loss, "data") if manual else loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - LR * g, params, grads))
        return loss

    return step


def batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    return x, y


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def run(step, model, x, y) -> tuple[list[float], list[np.ndarray]]:
    losses = [float(step(model, x, y)) for _ in range(STEPS)]
    return losses, params_of(model)


@pytest.fixture(scope="module")
def shard_map_compiled(mesh):
    """The compiled ml.shard_map step (also what its 5 steps run) and its model."""
    model = TPMLP(nnx.Rngs(0))
    step = ml.shard_map(
        make_step(manual=True), mesh=mesh, in_specs=(PLAN, P("data"), P("data")), out_specs=P()
    )
    return step.lower(model, *batch()).compile(), model


@pytest.fixture(scope="module")
def shard_map_run(shard_map_compiled):
    compiled, model = shard_map_compiled
    return run(compiled, model, *batch()), model


@pytest.fixture(scope="module")
def jit_run(mesh):
    step = ml.jit(make_step(manual=False), in_shardings=(PLAN, P("data"), P("data")), mesh=mesh)
    return run(step, TPMLP(nnx.Rngs(0)), *batch())


@pytest.fixture(scope="module")
def single_device_run():
    return run(nnx.jit(make_step(manual=False)), TPMLP(nnx.Rngs(0)), *batch())


def test_shard_map_and_jit_agree_and_equal_a_single_device_run(
    shard_map_run, jit_run, single_device_run
):
    (sm_losses, sm_params), _ = shard_map_run
    jit_losses, jit_params = jit_run
    ref_losses, ref_params = single_device_run
    assert sm_losses[-1] < sm_losses[0]  # it trained
    np.testing.assert_allclose(sm_losses, jit_losses, atol=1e-6)
    np.testing.assert_allclose(sm_losses, ref_losses, atol=1e-5)
    for sm, jt, ref in zip(sm_params, jit_params, ref_params, strict=True):
        np.testing.assert_allclose(sm, jt, atol=1e-6)
        np.testing.assert_allclose(sm, ref, atol=1e-5)


def test_updated_parameters_keep_the_plans_shardings(shard_map_run, mesh):
    _, model = shard_map_run
    assert model.up1.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    assert model.down2.kernel[...].sharding == NamedSharding(mesh, P("model", None))
    assert model.down2.bias[...].sharding == NamedSharding(mesh, P())


def hand_written_step(mesh):
    """The same step with jax.shard_map over a dict of arrays, as a JAX user would write it."""

    def step(params, x, y):
        def loss_fn(params):
            h = x
            for up, down in (("up1", "down1"), ("up2", "down2")):
                h = column(h, params[up]["kernel"], params[up]["bias"])
                h = row(h, params[down]["kernel"], params[down]["bias"], psum_model)
            return jax.lax.pmean(jnp.mean((h - y) ** 2), "data")

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

    mapped = jax.shard_map(
        step, mesh=mesh, in_specs=(SPECS, P("data"), P("data")), out_specs=(SPECS, P())
    )
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS)
    return jax.jit(mapped, in_shardings=(shardings, None, None)), shardings


def collectives(hlo: str) -> collections.Counter:
    kinds = r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
    return collections.Counter(re.findall(rf"\b({kinds})(?:-start)?\(", hlo))


def test_collectives_equal_the_hand_written_shard_map_step(shard_map_compiled, mesh):
    compiled, _ = shard_map_compiled
    step, shardings = hand_written_step(mesh)
    model = TPMLP(nnx.Rngs(0))
    params = {
        name: {"kernel": getattr(model, name).kernel[...], "bias": getattr(model, name).bias[...]}
        for name in LAYERS
    }
    params = jax.device_put(params, shardings)
    hand = step.lower(params, *batch()).compile()
    ours = collectives(compiled.as_text())
    assert ours == collectives(hand.as_text())
    # DESIGN.md's figure: 3 activation all-reduces over 'model' (2 forward, 1 backward)
    # and 1 all-reduce over 'data' of every gradient and the loss, combined.
    assert ours == {"all-reduce": 4}
