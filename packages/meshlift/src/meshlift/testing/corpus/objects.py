"""The libraries' own objects, each in a small job: every optax optimizer, schedule and
common wrapper, every nnx layer in its modes, and the state objects users pass.

A `Case` makes a fresh `Job` on a mesh: the stateful arguments (a model and
its `nnx.Optimizer`, metrics, a flax `TrainState`), the batch, and the step
that a transform lifts. The model of the optax cases is a two-layer MLP
annotated for tensor parallelism (`nnx.with_partitioning`), made under the
mesh, so flax places it as its metadata says.

Example:

```python
import jax
from meshlift.testing.corpus.objects import CASES

case = CASES["optax.adamw+warmup_cosine_decay_schedule"]
job = case.make(jax.make_mesh((2, 4), ("data", "model")))
assert [type(x).__name__ for x in job.state] == ["MLP", "Optimizer"]
```
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P


@attrs.define
class Job:
    """One run's objects. `step(*state, *batch)` is what a transform lifts; with
    `returns_state` (a functional `TrainState`), it returns `(new_state, output)` and the
    state is replaced by it after each call; `between(state)` runs between calls (a
    checkpoint round trip) and gives the state to go on with."""

    step: Callable[..., Any]
    state: list[Any]
    batch: tuple[Any, ...]
    returns_state: bool = False
    between: Callable[[list[Any]], list[Any]] | None = None
    calls: int = 2


@attrs.frozen
class Case:
    """A library object (`name`, as the library spells it) in a job made on a mesh."""

    name: str
    kind: str  # "optimizer", "schedule", "wrapper", "layer", "state"
    make: Callable[[Any], Job]


def _explicit(spec: P) -> P | None:
    """`spec` where the mesh in context shards in types (Explicit axes), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return spec if not mesh.empty and mesh.are_all_axes_explicit else None


_LECUN = nnx.initializers.lecun_normal()


class MLP(nnx.Module):
    """Two Linear layers split Megatron-style over `model` (column, then row), unless not
    `annotated`."""

    def __init__(self, rngs: nnx.Rngs, annotated: bool = True):
        by_column = nnx.with_partitioning(_LECUN, (None, "model")) if annotated else _LECUN
        by_row = nnx.with_partitioning(_LECUN, ("model", None)) if annotated else _LECUN
        self.l1 = nnx.Linear(4, 8, kernel_init=by_column, rngs=rngs)
        self.l2 = nnx.Linear(8, 4, kernel_init=by_row, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.l1(x)), out_sharding=_explicit(P("data", None)))


def _batch(shape: tuple[int, ...] = (8, 4), seed: int = 0, ints: int = 0) -> jax.Array:
    if ints:
        return jnp.asarray(np.random.default_rng(seed).integers(0, ints, shape), jnp.int32)
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def train_step(model: Any, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    """Forward, gradient, optimizer update; the loss."""
    loss, grads = nnx.value_and_grad(_mse)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _value_step(model: Any, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    """The train step of optimizers that read the loss (`polyak_sgd`) and the loss as a
    function of the parameters (`lbfgs`'s line search)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]

    def loss_of(p: Any) -> jax.Array:
        return _mse(nnx.merge(graphdef, p, rest), x, y)

    loss, grads = jax.value_and_grad(loss_of)(params)
    optimizer.update(model, grads, value=loss, grad=grads, value_fn=loss_of)
    return loss


def _training(
    tx: Callable[[], optax.GradientTransformation],
    step: Callable = train_step,
    annotated: bool = True,
):
    def make(mesh: Any) -> Job:
        with jax.set_mesh(mesh):
            model = MLP(nnx.Rngs(0), annotated)
            optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
        return Job(step, [model, optimizer], (_batch(), _batch(seed=1)), calls=3)

    return make


LR = 1e-2

# Every optimizer optax exports (its `alias` module, and the partials over it).
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adabelief": lambda: optax.adabelief(LR),
    "adadelta": lambda: optax.adadelta(LR),
    "adafactor": lambda: optax.adafactor(LR),
    "adagrad": lambda: optax.adagrad(LR),
    "adam": lambda: optax.adam(LR),
    "adamax": lambda: optax.adamax(LR),
    "adamaxw": lambda: optax.adamaxw(LR),
    "adamw": lambda: optax.adamw(LR),
    "adan": lambda: optax.adan(LR),
    "amsgrad": lambda: optax.amsgrad(LR),
    "fromage": lambda: optax.fromage(LR),
    "lamb": lambda: optax.lamb(LR),
    "lars": lambda: optax.lars(LR),
    "lbfgs": lambda: optax.lbfgs(),
    "lion": lambda: optax.lion(LR),
    "nadam": lambda: optax.nadam(LR),
    "nadamw": lambda: optax.nadamw(LR),
    "noisy_sgd": lambda: optax.noisy_sgd(LR, key=jax.random.key(0)),
    "novograd": lambda: optax.novograd(LR),
    "optimistic_adam": lambda: optax.optimistic_adam(LR),
    "optimistic_adam_v2": lambda: optax.optimistic_adam_v2(LR),
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(LR),
    "polyak_sgd": lambda: optax.polyak_sgd(),
    "radam": lambda: optax.radam(LR),
    "rmsprop": lambda: optax.rmsprop(LR),
    "rprop": lambda: optax.rprop(LR),
    "sgd": lambda: optax.sgd(LR, momentum=0.9),
    "sign_sgd": lambda: optax.sign_sgd(LR),
    "signum": lambda: optax.signum(LR),
    "sm3": lambda: optax.sm3(LR),
    "yogi": lambda: optax.yogi(LR),
}
READS_VALUES = {"lbfgs", "polyak_sgd"}
# Their state is not shaped like the parameters (factored moments, per-layer norms, a
# history): flax copies each parameter's sharding metadata onto it and fails to place it
# (flax's own error, as it makes the optimizer), so their MLP is left unannotated.
_UNLIKE_PARAMETERS = {"adafactor", "lbfgs", "novograd", "sm3"}

# Every schedule optax exports (`optax.schedules`), as adamw's learning rate.
SCHEDULES: dict[str, Callable[[], optax.Schedule]] = {
    "constant_schedule": lambda: optax.constant_schedule(LR),
    "cosine_decay_schedule": lambda: optax.cosine_decay_schedule(LR, 8),
    "cosine_onecycle_schedule": lambda: optax.cosine_onecycle_schedule(8, LR),
    "exponential_decay": lambda: optax.exponential_decay(LR, 2, 0.5),
    "join_schedules": lambda: optax.join_schedules(
        [optax.linear_schedule(0.0, LR, 2), optax.cosine_decay_schedule(LR, 8)], [2]
    ),
    "linear_onecycle_schedule": lambda: optax.linear_onecycle_schedule(8, LR),
    "linear_schedule": lambda: optax.linear_schedule(0.0, LR, 4),
    "piecewise_constant_schedule": lambda: optax.piecewise_constant_schedule(LR, {2: 0.5}),
    "piecewise_interpolate_schedule": lambda: optax.piecewise_interpolate_schedule(
        "cosine", LR, {2: 0.5}
    ),
    "polynomial_schedule": lambda: optax.polynomial_schedule(LR, LR / 10, 2, 4),
    "sgdr_schedule": lambda: optax.sgdr_schedule(
        [{"init_value": 0.0, "peak_value": LR, "warmup_steps": 2, "decay_steps": 8}] * 2
    ),
    "warmup_constant_schedule": lambda: optax.warmup_constant_schedule(0.0, LR, 2),
    "warmup_cosine_decay_schedule": lambda: optax.warmup_cosine_decay_schedule(0.0, LR, 2, 8),
    "warmup_exponential_decay_schedule": lambda: optax.warmup_exponential_decay_schedule(
        0.0, LR, 2, 2, 0.5
    ),
}


def _matrices(params: Any) -> Any:
    return jax.tree.map(lambda x: x.ndim > 1, params)


# The common wrappers, around adam(w) with a cosine schedule where one fits.
WRAPPERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(LR, 8))
    ),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(optax.cosine_decay_schedule(LR, 8)), 2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.cosine_decay_schedule(LR, 8)
    ),
    "inject_stateful_hyperparams": lambda: optax.inject_stateful_hyperparams(optax.adam)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, LR, 2, 8)
    ),
    "masked": lambda: optax.masked(optax.adam(optax.cosine_decay_schedule(LR, 8)), _matrices),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(optax.cosine_decay_schedule(LR, 8)), "vector": optax.sgd(LR)},
        lambda params: jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "vector", params),
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=2),
    "ema": lambda: optax.chain(optax.ema(0.9), optax.scale(-LR)),
}


# -- nnx layers -----------------------------------------------------------------------------


class Net(nnx.Module):
    """A layer under test, then a Linear read-out of everything but the batch axis."""

    def __init__(self, layer: Any, features: int, apply: Callable[..., Any], rngs: nnx.Rngs):
        self.layer = layer
        self.apply = apply  # a static function: how the layer is called
        self.out = nnx.Linear(features, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.apply(self.layer, x)
        return self.out(h.reshape(h.shape[0], -1))


def _call(layer: Any, x: jax.Array) -> jax.Array:
    return layer(x)


def _in_turn(layers: Any, x: jax.Array) -> jax.Array:
    for layer in layers.values() if isinstance(layers, nnx.Dict) else layers:
        x = layer(x)
    return x


def _layer(
    build: Callable[[nnx.Rngs], Any],
    x_shape: tuple[int, ...],
    features: int,
    mode: str | None = None,
    apply: Callable[..., Any] = _call,
    ints: int = 0,
):
    """A job training `Net(build(rngs))` with sgd on a batch of `x_shape` (token ids below
    `ints`, if given), in `mode` ("train"/"eval": `model.train()`/`model.eval()`)."""

    def make(mesh: Any) -> Job:
        with jax.set_mesh(mesh):
            rngs = nnx.Rngs(0, dropout=1)
            model = Net(build(rngs), features, apply, rngs)
            if mode is not None:
                getattr(model, mode)()
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        batch = (_batch(x_shape, ints=ints), _batch((x_shape[0], 4), seed=1))
        return Job(train_step, [model, optimizer], batch)

    return make


def _decode(model: Any, token: jax.Array) -> jax.Array:
    return model(token)


def _attention_decode(mesh: Any) -> Job:
    with jax.set_mesh(mesh):
        attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, qkv_features=8, decode=True, rngs=nnx.Rngs(0)
        )
        attention.init_cache((8, 4, 8))
    return Job(_decode, [attention], (_batch((8, 1, 8)),), calls=3)


def _rnn(cell: Callable[..., Any]) -> Callable[[nnx.Rngs], Any]:
    return lambda rngs: nnx.RNN(cell(4, 8, rngs=rngs))


_SEQ = (8, 3, 4)  # batch, time, features
LAYERS: dict[str, Callable[[Any], Job]] = {
    "Linear": _layer(lambda r: nnx.Linear(4, 8, rngs=r), (8, 4), 8),
    "LinearGeneral": _layer(lambda r: nnx.LinearGeneral(4, (2, 4), rngs=r), (8, 4), 8),
    "Einsum": _layer(lambda r: nnx.Einsum("bi,io->bo", (4, 8), (8,), rngs=r), (8, 4), 8),
    "Conv": _layer(lambda r: nnx.Conv(4, 4, kernel_size=(3,), rngs=r), _SEQ, 12),
    "ConvTranspose": _layer(lambda r: nnx.ConvTranspose(4, 4, kernel_size=(3,), rngs=r), _SEQ, 12),
    "Embed": _layer(lambda r: nnx.Embed(16, 4, rngs=r), (8, 3), 12, ints=16),
    "LayerNorm": _layer(lambda r: nnx.LayerNorm(4, rngs=r), _SEQ, 12),
    "RMSNorm": _layer(lambda r: nnx.RMSNorm(4, rngs=r), _SEQ, 12),
    "GroupNorm": _layer(lambda r: nnx.GroupNorm(4, num_groups=2, rngs=r), _SEQ, 12),
    "InstanceNorm": _layer(lambda r: nnx.InstanceNorm(4, rngs=r), _SEQ, 12),
    "BatchNorm train": _layer(lambda r: nnx.BatchNorm(4, rngs=r), _SEQ, 12, "train"),
    "BatchNorm eval": _layer(lambda r: nnx.BatchNorm(4, rngs=r), _SEQ, 12, "eval"),
    "Dropout train": _layer(lambda r: nnx.Dropout(0.5, rngs=r), (8, 4), 4, "train"),
    "Dropout eval": _layer(lambda r: nnx.Dropout(0.5, rngs=r), (8, 4), 4, "eval"),
    "MultiHeadAttention train": _layer(
        lambda r: nnx.MultiHeadAttention(2, 4, 8, dropout_rate=0.2, decode=False, rngs=r),
        _SEQ,
        12,
        "train",
    ),
    "MultiHeadAttention eval": _layer(
        lambda r: nnx.MultiHeadAttention(2, 4, 8, dropout_rate=0.2, decode=False, rngs=r),
        _SEQ,
        12,
        "eval",
    ),
    "MultiHeadAttention decode": _attention_decode,
    "RNN(LSTMCell)": _layer(_rnn(nnx.LSTMCell), _SEQ, 24),
    "RNN(OptimizedLSTMCell)": _layer(_rnn(nnx.OptimizedLSTMCell), _SEQ, 24),
    "RNN(GRUCell)": _layer(_rnn(nnx.GRUCell), _SEQ, 24),
    "RNN(SimpleCell)": _layer(_rnn(nnx.SimpleCell), _SEQ, 24),
    "Bidirectional": _layer(
        lambda r: nnx.Bidirectional(_rnn(nnx.GRUCell)(r), _rnn(nnx.GRUCell)(r)), _SEQ, 48
    ),
    "LoRA": _layer(lambda r: nnx.LoRA(4, 2, 8, rngs=r), (8, 4), 8),
    "LoRALinear": _layer(lambda r: nnx.LoRALinear(4, 8, lora_rank=2, rngs=r), (8, 4), 8),
    "PReLU": _layer(lambda r: nnx.PReLU(), (8, 4), 4),
    "Sequential": _layer(
        lambda r: nnx.Sequential(nnx.Linear(4, 8, rngs=r), nnx.relu, nnx.Linear(8, 4, rngs=r)),
        (8, 4),
        4,
    ),
    "List": _layer(
        lambda r: nnx.List([nnx.Linear(4, 8, rngs=r), nnx.Linear(8, 4, rngs=r)]),
        (8, 4),
        4,
        apply=_in_turn,
    ),
    "Dict": _layer(
        lambda r: nnx.Dict(a=nnx.Linear(4, 8, rngs=r), b=nnx.Linear(8, 4, rngs=r)),
        (8, 4),
        4,
        apply=_in_turn,
    ),
    "SpectralNorm train": _layer(
        lambda r: nnx.SpectralNorm(nnx.Linear(4, 8, rngs=r), rngs=r), (8, 4), 8, "train"
    ),
    "SpectralNorm eval": _layer(
        lambda r: nnx.SpectralNorm(nnx.Linear(4, 8, rngs=r), rngs=r), (8, 4), 8, "eval"
    ),
    "WeightNorm": _layer(lambda r: nnx.WeightNorm(nnx.Linear(4, 8, rngs=r), rngs=r), (8, 4), 8),
}
_ROPE: Any = getattr(nnx, "RoPE", None)  # flax 0.12.12 on: its sin and cos tables kept as Variables
if _ROPE is not None:
    LAYERS["RoPE"] = _layer(lambda r: _ROPE(embedding_size=4, max_seq_len=8), (8, 3, 1, 4), 12)


# -- state objects ----------------------------------------------------------------------------


def _metrics_step(model, optimizer, metrics, x, y):
    loss = train_step(model, optimizer, x, y)
    metrics.update(loss=loss, logits=model(x), labels=jnp.argmax(y, axis=-1))
    return loss


def _multi_metric(mesh: Any) -> Job:
    job = _training(lambda: optax.adam(LR))(mesh)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    return Job(_metrics_step, [*job.state, metrics], job.batch)


def _apply_gradients(state: train_state.TrainState, x: jax.Array, y: jax.Array):
    def loss_of(params: Any) -> jax.Array:
        out, _ = state.apply_fn(params)(x)
        return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    return state.apply_gradients(grads=grads), loss


def _train_state(mesh: Any) -> Job:
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
        state = train_state.TrainState.create(
            apply_fn=graphdef.apply,
            params=params,
            tx=optax.adamw(optax.cosine_decay_schedule(LR, 8)),
        )
    return Job(_apply_gradients, [state], (_batch(), _batch(seed=1)), returns_state=True, calls=3)


def _checkpoint_round_trip(state: list[Any]) -> list[Any]:
    """Save every object's state with orbax and restore it in place, each array onto the
    sharding it was saved from."""
    import orbax.checkpoint as ocp

    with tempfile.TemporaryDirectory() as directory, ocp.StandardCheckpointer() as checkpointer:
        for i, obj in enumerate(state):
            path = f"{directory}/{i}"
            checkpointer.save(path, nnx.state(obj))
            checkpointer.wait_until_finished()
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(obj))
            nnx.update(obj, checkpointer.restore(path, abstract))
    return state


def _orbax(mesh: Any) -> Job:
    job = _training(lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0.0, LR, 2, 8)))(mesh)
    job.between = _checkpoint_round_trip
    return job


STATES: dict[str, Callable[[Any], Job]] = {
    "nnx.MultiMetric": _multi_metric,
    "flax TrainState": _train_state,
    "orbax save/restore": _orbax,
}


# Every optax object of the corpus, by its name in it: an optimizer (`adamw`), adamw
# with a schedule (`adamw+cosine_decay_schedule`), or a wrapper (`MultiSteps`).
TRANSFORMATIONS: dict[str, Callable[[], optax.GradientTransformation]] = {
    **OPTIMIZERS,
    **{
        f"adamw+{name}": functools.partial(lambda s: optax.adamw(s()), schedule)
        for name, schedule in SCHEDULES.items()
    },
    **WRAPPERS,
}
KINDS = {**dict.fromkeys(OPTIMIZERS, "optimizer"), **dict.fromkeys(WRAPPERS, "wrapper")}


def _cases() -> dict[str, Case]:
    cases = [
        Case(
            f"optax.{name}",
            KINDS.get(name, "schedule"),
            _training(
                tx,
                _value_step if name in READS_VALUES else train_step,
                annotated=name not in _UNLIKE_PARAMETERS,
            ),
        )
        for name, tx in TRANSFORMATIONS.items()
    ]
    cases += [Case(f"nnx.{name}", "layer", make) for name, make in LAYERS.items()]
    cases += [Case(name, "state", make) for name, make in STATES.items()]
    return {case.name: case for case in cases}


CASES = _cases()
