"""A stack of layers run as a scan, or as the backend staging the step runs stacks.

`ml.scan_layers(f, init, xs)` is `jax.lax.scan(f, init, xs)` for a stack of
layers: `xs` holds each layer's weights along a leading layer axis (modules made
by `nnx.vmap` among them) and `f(carry, layer) -> (carry, y)`. As under `nnx.scan`,
what `f` changes in a layer's Variables other than its `nnx.Param`s (an RNG
stream's count, batch statistics, a counter) is written back into the stack. A
model written with it runs as a plain scan under every backend, and as the
backend staging the step says where one says otherwise: the pipeline backend
(`meshlift-pipeline`) runs the stack as stages over microbatches. A backend does so
by tracing the step `with running(scan)`.

Example:

```python
import jax.numpy as jnp
import meshlift as ml

weights = jnp.ones((4, 3, 3)) / 3  # 4 layers
y, _ = ml.scan_layers(lambda x, w: (jnp.tanh(x @ w), None), jnp.ones((2, 3)), weights)
assert y.shape == (2, 3)
```
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib

#: `body(carry, x, state) -> (carry, y, state)`, for one layer: `x` its constant part,
#: `state` the part it may change.
Body = Callable[[Any, Any, Any], tuple[Any, Any, Any]]

#: `scan(body, init, xs, state) -> (carry, ys, state)`: run `body` over the layers
#: (the leading axis of `xs` and `state`) in order, each layer's state as `body` left it.
Scan = Callable[[Body, Any, Any, Any], tuple[Any, Any, Any]]

_RUNNING: contextvars.ContextVar[Scan | None] = contextvars.ContextVar(
    "meshlift_layer_scan", default=None
)


def scan_layers(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
    """`jax.lax.scan(f, init, xs)` over a stack of layers, or as the staging backend runs
    stacks (pipelined, under the pipeline backend); Variables other than `nnx.Param`s
    that `f` changes are written back into the stack's modules.

    Args:
        f: `f(carry, layer) -> (carry, y)`, as for `jax.lax.scan`; a pipelined stack
            takes `y = None` only.
        init: The carry: the activations, the batch along each leaf's leading axis.
        xs: The layers: a pytree (modules included) whose leaves have a leading layer axis.

    Returns:
        `(carry, ys)`, as `jax.lax.scan` returns them.
    """
    scan = _RUNNING.get() or plain_scan
    leaves, treedef = jax.tree.flatten(xs, is_leaf=graphlib.is_graph_node)
    where = [i for i, leaf in enumerate(leaves) if graphlib.is_graph_node(leaf)]
    nodes = [leaves[i] for i in where]
    graphdef, *states = nnx.split(nodes, nnx.Param, ...)
    params, state = states

    def body(carry: Any, x: Any, state: Any) -> tuple[Any, Any, Any]:
        others, params = x
        layer = nnx.merge(graphdef, params, state)
        merged = list(others)
        for i, node in zip(where, layer, strict=True):
            merged.insert(i, node)
        carry, y = f(carry, jax.tree.unflatten(treedef, merged))
        return carry, y, nnx.state(layer, nnx.Not(nnx.Param))

    others = [leaf for i, leaf in enumerate(leaves) if i not in where]
    carry, ys, state = scan(body, init, (others, params), state)
    nnx.update(nodes, state)
    return carry, ys


def plain_scan(body: Body, init: Any, xs: Any, state: Any) -> tuple[Any, Any, Any]:
    """`jax.lax.scan` over the layers: the `Scan` of every backend but the pipeline."""

    def step(carry: Any, layer: tuple[Any, Any]) -> tuple[Any, tuple[Any, Any]]:
        carry, y, new = body(carry, *layer)
        return carry, (y, new)

    carry, (ys, state) = jax.lax.scan(step, init, (xs, state))
    return carry, ys, state


@contextlib.contextmanager
def running(scan: Scan) -> Iterator[None]:
    """Within it, `scan_layers` runs its stacks with `scan(body, init, xs, state)`: what a
    backend's staged function wraps its trace in.

    Args:
        scan: A `Scan`, called for each stack of layers traced within.
    """
    token = _RUNNING.set(scan)
    try:
        yield
    finally:
        _RUNNING.reset(token)
