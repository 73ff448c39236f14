"""The conformance kit's tiny models, plans and steps, each in a global and a per-shard form.

A backend whose function sees global arrays (`jax.jit`-like) runs the
global form; a backend with the `manual-collectives` capability runs the
function once per shard and gets the per-shard form, which writes its
collectives out: the row-parallel matmul sums over `model` with `psum`,
and the loss (not the gradients) is averaged over `data` with `pmean`
inside the differentiated function. (Averaging the gradients instead would
double count under `shard_map`'s `check_vma=True`, which already sums the
gradients of parameters replicated over `data`: capability `vma-gradients`.)
A per-shard backend without `vma-gradients` gets the pmap-era step, which
averages its gradients itself.

Example:

```python
from jax.sharding import PartitionSpec as P
import meshlift as ml
from meshlift.testing import models

backend, mesh = ml.get_backend("jit"), ml.make_mesh({"data": 2, "model": 4})
step = ml.transform(backend, models.train_step(per_shard=False), mesh=mesh,
                    in_specs=(models.TENSOR_PARALLEL, models.TENSOR_PARALLEL,
                              P("data"), P("data")), out_specs=P())
```
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

BATCH, WIDTH, HIDDEN = 16, 16, 32
STEPS = 2
TOLERANCE = 1e-5


def graph_mode_jit(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """`nnx.jit` in flax's graph mode with graph updates, whatever the global mode.

    That is the semantics meshlift keeps, so it is the reference the suite
    compares with, also when a user switches tree mode on
    (`nnx.set_graph_mode(False)`). A flax without the switches has only
    graph mode.
    """
    switches = inspect.signature(nnx.jit).parameters.keys() & {"graph", "graph_updates"}
    jit: Callable[..., Any] = nnx.jit
    return jit(fun, **dict.fromkeys(switches, True), **options)


def graph_mode_cached_partial(fun: Callable[..., Any], *nodes: Any) -> Callable[..., Any]:
    """`nnx.cached_partial` in flax's graph mode, whatever the global mode (it exists only
    there), as `graph_mode_jit` is `nnx.jit`'s."""
    switches = inspect.signature(nnx.cached_partial).parameters.keys() & {"graph", "graph_updates"}
    return nnx.cached_partial(fun, *nodes, **dict.fromkeys(switches, True))


class MLP(nnx.Module):
    """`linear1` column parallel, `linear2` row parallel (no bias, so one psum sums it)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.linear2 = nnx.Linear(HIDDEN, WIDTH, use_bias=False, rngs=rngs)


TENSOR_PARALLEL = ml.StateSharding(
    {
        ml.path_endswith("linear1", "kernel"): P(None, "model"),
        ml.path_endswith("linear1", "bias"): P("model"),
        ml.path_endswith("linear2", "kernel"): P("model", None),
        ...: P(),
    }
)
REPLICATED = ml.StateSharding({...: P()})


def forward(model: MLP, x: jax.Array, *, per_shard: bool = False) -> jax.Array:
    """The MLP; per shard, `linear2`'s partial sums are added up over `model`."""
    y = model.linear2(jax.nn.relu(model.linear1(x)))
    return jax.lax.psum(y, "model") if per_shard else y


def loss_fn(
    per_shard: bool, average: bool = True
) -> Callable[[MLP, jax.Array, jax.Array], jax.Array]:
    """Mean squared error over the whole batch; per shard, the loss is averaged over `data`
    (unless not `average`: the shard's own loss)."""

    def loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
        value = jnp.mean((forward(model, x, per_shard=per_shard) - y) ** 2)
        return jax.lax.pmean(value, "data") if per_shard and average else value

    return loss


def train_step(per_shard: bool, sums_gradients: bool = True) -> Callable[..., jax.Array]:
    """`(model, optimizer, x, y) -> loss`: one Adam step, updating both in place.

    Per shard and without `sums_gradients` (pmap's semantics, `shard_map`'s
    `check_vma=False`), the step differentiates its own shard's loss and
    averages the gradients over `data` itself; the transpose of the forward
    `psum` counts the replicated loss once per `model` device, so it divides
    by that axis's size.
    """
    if per_shard and not sums_gradients:
        return _pmap_era_step
    loss = loss_fn(per_shard)

    def step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
        value, grads = nnx.value_and_grad(loss)(model, x, y)
        optimizer.update(model, grads)
        return value

    return step


def _pmap_era_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    value, grads = nnx.value_and_grad(loss_fn(per_shard=True, average=False))(model, x, y)
    devices = jax.lax.psum(1, "model")
    optimizer.update(model, jax.tree.map(lambda g: jax.lax.pmean(g, "data") / devices, grads))
    return jax.lax.pmean(value, "data")


def make_mlp(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def batch() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    return x, y


@functools.cache
def reference_training() -> tuple[list[float], dict[tuple[str, ...], np.ndarray]]:
    """Losses and final model and optimizer state of an eager single-device run."""
    model, optimizer = make_mlp()
    x, y = batch()
    step = train_step(per_shard=False)
    losses = [float(step(model, optimizer, x, y)) for _ in range(STEPS)]
    return losses, {**flat_arrays(model), **flat_arrays(optimizer, "optimizer")}


# -- BatchNorm and dropout ------------------------------------------------------------------
STATS_PLAN = ml.StateSharding({nnx.BatchStat: P("model"), ...: P("model")})


def make_batchnorm(per_shard: bool) -> nnx.BatchNorm:
    """Per shard, BatchNorm averages its batch statistics over `data` itself."""
    return nnx.BatchNorm(WIDTH, axis_name="data" if per_shard else None, rngs=nnx.Rngs(0))


def make_dropout() -> nnx.Dropout:
    return nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))


# -- helpers ----------------------------------------------------------------------------------
def array_of(value: Any) -> jax.Array:
    return value.get_value() if isinstance(value, nnx.Variable) else value


def flat_variables(node: Any, prefix: str | None = None) -> list[tuple[tuple[str, ...], Any]]:
    """(path, Variable) for every Variable of an NNX object, paths as strings."""
    head = (prefix,) if prefix else ()
    return [((*head, *map(str, path)), value) for path, value in nnx.to_flat_state(nnx.state(node))]


def flat_arrays(node: Any, prefix: str | None = None) -> dict[tuple[str, ...], np.ndarray]:
    out = {}
    for path, value in flat_variables(node, prefix):
        array = array_of(value)
        if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
            array = jax.random.key_data(array)
        out[path] = np.asarray(array)
    return out


def misplaced(
    node: Any, plan: ml.StateSharding, mesh: jax.sharding.Mesh
) -> list[tuple[str, Any, Any]]:
    """(path, actual sharding, planned spec) of each Variable not placed as the plan says."""
    wrong = []
    for path, value in flat_variables(node):
        array = array_of(value)
        spec = plan.spec_for(path, value)
        spec = P() if spec is None else spec
        planned = NamedSharding(mesh, spec) if isinstance(spec, P) else spec
        if not array.sharding.is_equivalent_to(planned, array.ndim):
            wrong.append((".".join(path), getattr(array.sharding, "spec", array.sharding), spec))
    return wrong
