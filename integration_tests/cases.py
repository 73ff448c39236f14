"""The models of the integration suite: each with a plan, a train step, and a reference.

A case is run the same way under every installed backend. Backends whose
function sees global arrays (capability ``auto-partitioning``) run ``step``
with the case's plan; backends whose function sees one shard (capability
``manual-collectives``) run ``manual_step``, which averages gradients over
``data`` itself, with ``manual_plan``. A case lists the capabilities it
``requires``; a backend that lacks one is expected to fail it (a strict xfail).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml

BATCH = 16
STEPS = 3


@attrs.frozen
class Case:
    name: str
    make: Callable[[bool], Any]  # manual -> (model, optimizer), same numbers each call
    batch: Callable[[], tuple[jax.Array, jax.Array]]
    plan: ml.StateSharding
    manual_plan: ml.StateSharding | None = None
    requires: frozenset[str] = frozenset()
    tolerance: float = 1e-5
    data_parallel: bool = False  # the plan replicates every parameter

    def step(self, manual: bool) -> Callable[..., jax.Array]:
        return manual_train_step if manual else train_step


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def manual_train_step(model, optimizer, x, y):
    """The same step on one shard of the batch: average loss and gradients over ``data``."""
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    grads = jax.lax.pmean(grads, "data")
    optimizer.update(model, grads)
    return jax.lax.pmean(loss, "data")


def adam(model: nnx.Module) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def batch_of(shape: tuple[int, ...], out: int) -> Callable[[], tuple[jax.Array, jax.Array]]:
    def make() -> tuple[jax.Array, jax.Array]:
        x = jax.random.normal(jax.random.key(1), (BATCH, *shape))
        y = jax.random.normal(jax.random.key(2), (BATCH, out))
        return x, y

    return make


REPLICATED = ml.StateSharding({...: P()})


# -- MLP, tensor parallel by path filters -------------------------------------------------
class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jax.nn.relu(self.linear1(x)))


def make_mlp(manual: bool):
    model = MLP(nnx.Rngs(0))
    return model, adam(model)


MLP_CASE = Case(
    name="mlp",
    make=make_mlp,
    batch=batch_of((16,), 16),
    plan=ml.StateSharding(
        {
            ml.path_endswith("linear1", "kernel"): P(None, "model"),
            ml.path_endswith("linear1", "bias"): P("model"),
            ml.path_endswith("linear2", "kernel"): P("model", None),
            ...: P(),
        }
    ),
    manual_plan=REPLICATED,
)

MLP_DATA_PARALLEL = attrs.evolve(
    MLP_CASE, name="mlp-data-parallel", plan=REPLICATED, data_parallel=True
)


# -- CNN with BatchNorm and dropout ------------------------------------------------------
class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, axis_name: str | None = None):
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would amplify.
        self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = self.drop(jax.nn.relu(self.bn(self.conv(x))))
        return self.head(x.mean(axis=(1, 2)))


def make_cnn(manual: bool):
    model = CNN(nnx.Rngs(0, dropout=1), axis_name="data" if manual else None)
    return model, adam(model)


CNN_CASE = Case(
    name="cnn-batchnorm-dropout",
    make=make_cnn,
    batch=batch_of((8, 8, 3), 4),
    plan=ml.StateSharding(
        {
            ml.path_endswith("conv", "kernel"): P(None, None, None, "model"),
            nnx.BatchStat: P("model"),
            ml.path_endswith("bn", "scale"): P("model"),
            ml.path_endswith("bn", "bias"): P("model"),
            ...: P(),
        }
    ),
    manual_plan=REPLICATED,
    requires=frozenset({"global-rng"}),
)

CASES = [MLP_CASE, MLP_DATA_PARALLEL, CNN_CASE]


# -- shared by the suite's tests -----------------------------------------------------------
def installed_backends() -> list[str]:
    return sorted(b.name for b in ml.backends())


def is_manual(backend: ml.Backend) -> bool:
    return "manual-collectives" in backend.capabilities


@functools.cache
def reference(case: Case) -> tuple[list[float], list[np.ndarray]]:
    """Losses and final parameters of a plain single-device run with flax's own nnx.jit."""
    model, optimizer = case.make(False)
    x, y = case.batch()
    step = nnx.jit(case.step(False))
    losses = [float(step(model, optimizer, x, y)) for _ in range(STEPS)]
    return losses, [as_numpy(v) for v in jax.tree.leaves(nnx.state(model))]


def as_numpy(value) -> np.ndarray:
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value)
