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
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import meshlift as ml

BATCH = 16
STEPS = 3


@attrs.frozen
class Case:
    """A model, its plan and its step; ``make(manual)`` builds the state arguments afresh.

    ``loss(model_or_apply, x, y)`` is the training loss; NNX cases run
    ``(model, optimizer, x, y) -> loss`` steps that update in place, linen
    cases run ``(state, x, y) -> (state, loss)``.
    """

    name: str
    make: Callable[[bool], tuple[Any, ...]]
    batch: Callable[[], tuple[jax.Array, jax.Array]]
    plan: ml.StateSharding
    manual_plan: ml.StateSharding | None = None
    requires: frozenset[str] = frozenset()
    tolerance: float = 1e-5
    data_parallel: bool = False  # the plan replicates every parameter
    loss: Callable[..., jax.Array] = attrs.field(factory=lambda: mse)
    linen: bool = False

    def step(self, backend: ml.Backend | None = None) -> Callable[..., Any]:
        """The step as `backend` runs it (None: one device): per shard with
        `manual-collectives`, averaging its own gradients without `vma-gradients`."""
        make = linen_step if self.linen else nnx_step
        if backend is None or not is_manual(backend):
            return make(self.loss, None)
        return make(self.loss, "data", "vma-gradients" in backend.capabilities)

    def train(self, step: Callable[..., Any], state: tuple[Any, ...], x, y) -> tuple[Any, float]:
        """One step; returns the new state arguments and the loss."""
        if self.linen:
            new_state, loss = step(*state, x, y)
            return (new_state,), float(loss)
        return state, float(step(*state, x, y))

    def params(self, state: tuple[Any, ...]) -> list[tuple[tuple[str, ...], Any]]:
        """(path, array) of every parameter and statistic, in a fixed order."""
        if self.linen:
            tree = ml.unbox(state[0].params)
            flat = jax.tree_util.tree_flatten_with_path(tree)[0]
            return [(("params", *map(key_name, path)), value) for path, value in flat]
        return [(tuple(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(state[0]))]

    def steps_taken(self, state: tuple[Any, ...]) -> int:
        return int(state[0].step if self.linen else state[1].step[...])


def key_name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def cross_entropy(model, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def global_loss(loss_fn, data_axis: str | None):
    """On one shard, the loss averaged over ``data_axis``: its gradient is then the global one.

    (Averaging the gradients afterwards would be wrong under shard_map's default
    check_vma=True, which already sums the gradients of replicated parameters.)
    """
    if data_axis is None:
        return loss_fn
    return lambda *args: jax.lax.pmean(loss_fn(*args), data_axis)


def nnx_step(loss_fn, data_axis: str | None, sums_gradients: bool = True):
    """A train step; with ``data_axis`` it runs on one shard of the batch. Without
    ``sums_gradients`` (pmap's semantics, no capability ``vma-gradients``) it averages
    each shard's gradients itself."""
    averages = data_axis is not None and not sums_gradients
    loss_fn = loss_fn if averages else global_loss(loss_fn, data_axis)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        if averages:
            loss, grads = jax.lax.pmean((loss, grads), data_axis)
        optimizer.update(model, grads)
        return loss

    return train_step


def linen_step(loss_fn, data_axis: str | None, sums_gradients: bool = True):
    averages = data_axis is not None and not sums_gradients
    loss_fn = loss_fn if averages else global_loss(loss_fn, data_axis)

    def train_step(state, x, y):
        def loss_of(params):
            return loss_fn(lambda v: state.apply_fn({"params": params}, v), x, y)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        if averages:
            loss, grads = jax.lax.pmean((loss, grads), data_axis)
        return state.apply_gradients(grads=grads), loss

    return train_step


def adam(model: nnx.Module, eps: float = 1e-8) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adam(1e-2, eps=eps), wrt=nnx.Param)


def with_adam(model_type: type[nnx.Module]) -> Callable[[bool], tuple[Any, ...]]:
    """``make`` for a case: a fresh model (same seed every time) and its Adam optimizer."""

    def make(manual: bool) -> tuple[Any, ...]:
        model = model_type(nnx.Rngs(0))
        return model, adam(model)

    return make


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


MLP_CASE = Case(
    name="mlp",
    make=with_adam(MLP),
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


# -- transformer blocks: heads and MLP sharded, tied embedding, logical names ----------------
VOCAB, EMBED, HEADS, SEQ = 64, 32, 8, 8
RULES = (("vocab", "model"), ("heads", "model"), ("mlp", "model"), ("embed", None))


def logical(*names: str | None):
    return ml.with_logical_partitioning(nnx.initializers.lecun_normal(), names)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(EMBED, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=EMBED,
            qkv_features=EMBED,
            decode=False,
            use_bias=False,  # a key bias has zero true gradient; Adam would amplify the rounding
            kernel_init=logical("embed", "heads", None),
            out_kernel_init=logical("heads", None, "embed"),
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(EMBED, rngs=rngs)
        self.up = nnx.Linear(EMBED, 2 * EMBED, kernel_init=logical("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(2 * EMBED, EMBED, kernel_init=logical("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, embedding_init=logical("vocab", "embed"), rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = self.embed  # tied input/output embedding: one shared Variable

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head.attend(x)


def make_transformer(manual: bool):
    model = Transformer(nnx.Rngs(0))
    # Adam's step is lr * g / (|g| + eps): with the default eps, float32 rounding in the
    # near-zero gradients of attention weights (which differs with each mesh's reduction
    # order) moves single weights by up to 1e-3. A larger eps bounds that amplification.
    return model, adam(model, eps=1e-3)


def token_batch():
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    return tokens, jnp.roll(tokens, -1, axis=1)


TRANSFORMER_CASE = Case(
    name="transformer-tied-logical",
    make=make_transformer,
    batch=token_batch,
    plan=ml.StateSharding.from_metadata(nnx.eval_shape(lambda: Transformer(nnx.Rngs(0))), RULES),
    manual_plan=REPLICATED,
    loss=cross_entropy,
    tolerance=2e-5,
)


# -- stacked layers: nnx.vmap to build, nnx.scan to run, a 'layers' partition axis ------------
class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, kernel_init=logical("embed", "mlp"), rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.linear(x))


class Stack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Layer(rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(
            in_axes=(nnx.Carry, 0),
            out_axes=nnx.Carry,
            transform_metadata={nnx.PARTITION_NAME: "layers"},
        )
        def run(x, layer):
            return layer(x)

        return run(x, self.layers)


STACK_CASE = Case(
    name="scan-stacked-layers",
    make=with_adam(Stack),
    batch=batch_of((16,), 16),
    plan=ml.StateSharding.from_metadata(
        nnx.eval_shape(lambda: Stack(nnx.Rngs(0))), (("layers", None), *RULES)
    ),
    manual_plan=REPLICATED,
)


# -- linen: Partitioned boxes and an optax TrainState ----------------------------------------
class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(32, kernel_init=ml.with_partitioning(init, (None, "model")))(x)
        return nn.Dense(16, kernel_init=ml.with_partitioning(init, ("model", None)))(jax.nn.relu(x))


def make_linen(manual: bool):
    module = LinenMLP()
    variables = module.init(jax.random.key(0), jnp.ones((1, 16)))
    state = train_state.TrainState.create(
        apply_fn=module.apply, params=variables["params"], tx=optax.adam(1e-2)
    )
    return (state,)


LINEN_CASE = Case(
    name="linen-partitioned-trainstate",
    make=make_linen,
    batch=batch_of((16,), 16),
    plan=ml.StateSharding.from_metadata(jax.eval_shape(lambda: make_linen(False)[0])),
    manual_plan=REPLICATED,
    # Unboxing a Partitioned box applies with_sharding_constraint, which JAX refuses
    # over manual (per-shard) mesh axes.
    requires=frozenset({"auto-partitioning"}),
    linen=True,
)

CASES = [MLP_CASE, MLP_DATA_PARALLEL, CNN_CASE, TRANSFORMER_CASE, STACK_CASE, LINEN_CASE]


# -- shared by the suite's tests -----------------------------------------------------------
def installed_backends() -> list[str]:
    return sorted(b.name for b in ml.backends())


def is_manual(backend: ml.Backend) -> bool:
    return "manual-collectives" in backend.capabilities


@functools.cache
def reference(case: Case) -> tuple[list[float], list[np.ndarray]]:
    """Losses and final parameters of a plain single-device run (flax's nnx.jit, or jax.jit)."""
    state = case.make(False)
    x, y = case.batch()
    step = (jax.jit if case.linen else nnx.jit)(case.step())
    losses = []
    for _ in range(STEPS):
        state, loss = case.train(step, state, x, y)
        losses.append(loss)
    return losses, [as_numpy(v) for _, v in case.params(state)]


def as_numpy(value) -> np.ndarray:
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value)
