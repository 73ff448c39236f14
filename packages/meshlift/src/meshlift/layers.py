"""A stack of layers run as a scan, or as the backend staging the step runs stacks.

`ml.scan_layers(f, init, xs)` is `jax.lax.scan(f, init, xs)` for a stack of
layers: `xs` holds each layer's weights along a leading layer axis and
`f(carry, layer) -> (carry, None)`. A model written with it runs as a plain scan
under every backend, and as the backend staging the step says where one says
otherwise: the pipeline backend (`meshlift-pipeline`) runs the stack as stages over
microbatches. A backend does so by tracing the step `with running(scan)`.

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

Scan = Callable[[Callable[[Any, Any], tuple[Any, Any]], Any, Any], tuple[Any, Any]]

_RUNNING: contextvars.ContextVar[Scan | None] = contextvars.ContextVar(
    "meshlift_layer_scan", default=None
)


def scan_layers(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
    """`jax.lax.scan(f, init, xs)` over a stack of layers, or as the staging backend runs
    stacks (pipelined, under the pipeline backend).

    Args:
        f: `f(carry, layer) -> (carry, y)`, as for `jax.lax.scan`; a pipelined stack
            takes `y = None` only.
        init: The carry: the activations, the batch along each leaf's leading axis.
        xs: The layers: a pytree (modules included) whose leaves have a leading layer axis.

    Returns:
        `(carry, ys)`, as `jax.lax.scan` returns them.
    """
    scan = _RUNNING.get()
    return jax.lax.scan(f, init, xs) if scan is None else scan(f, init, xs)


@contextlib.contextmanager
def running(scan: Scan) -> Iterator[None]:
    """Within it, `scan_layers` calls `scan(f, init, xs)`: what a backend's staged function
    wraps its trace in.

    Args:
        scan: Called as `jax.lax.scan` is, for each stack of layers traced within.
    """
    token = _RUNNING.set(scan)
    try:
        yield
    finally:
        _RUNNING.reset(token)
