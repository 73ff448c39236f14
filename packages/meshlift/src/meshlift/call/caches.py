"""What a lifted function remembers between calls, none of it keeping a caller's model alive.

`LayoutCache` holds a function's last few entries by argument layout, each
forgotten when one of its graph nodes is collected (a call like the last
one skips it: see `meshlift.speedups.CallPlan`). `shared_stages` is the
cache of staged functions, keyed by structure only and shared by every
lifted wrapper of one function and options, as `jax.jit` shares its cache
between wrappers.

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
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax

from meshlift.plans.sharding import is_spec

_MAX_ENTRIES = 8  # argument layouts remembered per lifted function

# fun -> options key -> staged key -> staged function; an entry goes with its function
_STAGES: weakref.WeakKeyDictionary[Any, dict[Hashable, dict[Hashable, Any]]] = (
    weakref.WeakKeyDictionary()
)


def options_key(spec_trees: Iterable[Any], *options: Any) -> Hashable | None:
    """Everything besides the arguments that staged functions depend on: the spec trees
    (by their leaves) and the other options; None if one is unhashable (then a lifted
    function keeps its staged functions to itself)."""
    is_leaf = lambda x: is_spec(x) or x is None  # noqa: E731
    specs = tuple(
        (treedef, tuple(leaves))
        for leaves, treedef in (jax.tree.flatten(tree, is_leaf=is_leaf) for tree in spec_trees)
    )
    key = (*specs, *options)
    try:
        hash(key)
    except TypeError:
        return None
    return key


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

    def discard(self, entry: Any) -> None:
        """Forget `entry`, under whichever key it is held."""
        for key in [key for key, (held, _) in self._items.items() if held is entry]:
            del self._items[key]

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
