"""Lifted methods: the instance a method is called on is lifted as its first argument.

`ml.jit(model.method)` lifts the function of a bound method whose instance
is a graph node (a module): the instance is read afresh at each call, never
captured, so its updates are written back as for any argument. A `Lifted`
stored on a class is a descriptor: `model.step(x)` calls it with `model`
first.

Example:

```python
import jax.numpy as jnp
from flax import nnx
import meshlift as ml

class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros(()))

    def add(self, by):
        self.count[...] += by

    @ml.jit
    def double(self):
        self.count[...] *= 2

counter = Counter()
ml.jit(counter.add)(2.0)        # a bound method: counter is lifted as its first argument
counter.double()                # a Lifted on the class: counter is passed first
assert float(counter.count[...]) == 4.0
```
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import attrs

from meshlift.backend import Specs
from meshlift.graph.split import is_graph_leaf


class BoundLifted:
    """A Lifted accessed as a method: the instance is passed as the first argument."""

    def __init__(self, lifted: Any, obj: Any):
        self._lifted, self._obj = lifted, obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted(self._obj, *args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.trace(self._obj, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.lower(self._obj, *args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.eval_shape(self._obj, *args, **kwargs)


def graph_receiver(fun: Callable[..., Any]) -> Any:
    """The graph node a bound method `fun` belongs to (it is lifted as an argument, read
    afresh at each call, never captured), else None."""
    receiver = getattr(fun, "__self__", None)
    if isinstance(fun, types.MethodType) and is_graph_leaf(receiver):
        return receiver
    return None


def after_receiver(
    static_argnums: Any, static_argnames: Any, donate_argnums: Any, donate_argnames: Any
) -> tuple[Any, Any, Any, Any]:
    """The argument options of a bound method for its function, the receiver first."""

    def shifted(nums: Any) -> Any:
        if nums is None:
            return None
        nums = (nums,) if isinstance(nums, int) else tuple(nums)
        return tuple(i + 1 if i >= 0 else i for i in nums)

    return shifted(static_argnums), static_argnames, shifted(donate_argnums), donate_argnames


def with_receiver_spec(specs: Specs) -> Specs:
    """Specs of a bound method's arguments, with `None` (unspecified) for the receiver
    where they are given per argument."""

    def prepended(specs: Any) -> Any:
        return (None, *specs) if isinstance(specs, tuple | list) else specs

    meshless = specs.meshless
    if meshless is not None:
        meshless = (prepended(meshless[0]), meshless[1])
    return attrs.evolve(specs, in_specs=prepended(specs.in_specs), meshless=meshless)
