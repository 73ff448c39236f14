"""What a lifted function remembers between calls, none of it keeping a caller's model alive.

`LayoutCache` holds a function's last few entries by argument layout, each
forgotten when one of its graph nodes is collected; `Repeat` lets a call
with the very arguments of the last one skip the flatten and the lookup;
`shared_stages` is the cache of staged functions, keyed by structure only
and shared by every lifted wrapper of one function and options, as
`jax.jit` shares its cache between wrappers.

Example:

```python
import gc
import jax.numpy as jnp
import meshlift as ml
from flax import nnx

step = ml.jit(lambda m, x: m(x))
model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
step(model, jnp.ones((1, 2)))
assert len(step._entries) == 1
del model
gc.collect()
assert len(step._entries) == 0     # the entry went with the model
```
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import weakref
from collections.abc import Callable, Hashable
from typing import Any

_MAX_ENTRIES = 8  # argument layouts remembered per lifted function

# fun -> options key -> staged key -> staged function; an entry goes with its function
_STAGES: weakref.WeakKeyDictionary[Any, dict[Hashable, dict[Hashable, Any]]] = (
    weakref.WeakKeyDictionary()
)


def shared_stages(fun: Callable[..., Any], options_key: Hashable | None) -> dict[Hashable, Any]:
    """The staged functions of every lifted `fun` with these options (a dict of its own
    if the options are unhashable or `fun` cannot be weakly referenced)."""
    if options_key is None:
        return {}
    try:
        return _STAGES.setdefault(fun, {}).setdefault(options_key, {})
    except TypeError:  # a function that cannot be weakly referenced or hashed
        return {}


class LayoutCache:
    """The last few entries by key; an entry is forgotten as soon as one of its nodes is
    collected."""

    def __init__(self) -> None:
        self._items: collections.OrderedDict[Hashable, tuple[Any, list]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> Any:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)  # least recently used goes first
        return item[0]

    def put(self, key: Hashable, entry: Any, nodes: tuple[Any, ...]) -> None:
        forget = functools.partial(_forget, weakref.ref(self), key)
        guards = []
        for node in nodes:
            with contextlib.suppress(TypeError):  # a Variable passed directly: held until evicted
                guards.append(weakref.ref(node, forget))
        self._items[key] = (entry, guards)
        if len(self._items) > _MAX_ENTRIES:
            self._items.popitem(last=False)


def _forget(cache_ref: Any, key: Hashable, _: Any) -> None:
    cache = cache_ref()
    if cache is not None:
        cache._items.pop(key, None)


class Repeat:
    """A call whose arguments are all graph nodes or arrays, and its entry: the next call
    with arguments of the same types, the same nodes and the same mesh has the same key,
    so it skips the flatten and the lookup. Nodes are held weakly, as the cache holds them.
    """

    __slots__ = ("entry", "mesh", "positions", "refs", "types")

    def __init__(
        self,
        types: tuple[type, ...],
        positions: tuple[int, ...],
        refs: tuple,
        mesh: Any,
        entry: Any,
    ):
        self.types = types
        self.positions = positions
        self.refs = refs  # weak references to the nodes at `positions`
        self.mesh = mesh
        self.entry = entry

    @classmethod
    def of(cls, args: tuple, positions: tuple[int, ...], mesh: Any, entry: Any) -> Repeat | None:
        try:
            refs = tuple(weakref.ref(args[i]) for i in positions)
        except TypeError:  # a node that takes no weak reference
            return None
        return cls(tuple(map(type, args)), positions, refs, mesh, entry)

    def matches(self, args: tuple) -> bool:
        nodes = map(args.__getitem__, self.positions)
        return tuple(map(type, args)) == self.types and all(
            map(operator.is_, nodes, map(operator.call, self.refs))
        )
