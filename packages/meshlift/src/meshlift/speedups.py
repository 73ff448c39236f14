"""The per-call loops over many objects: in C where meshlift's extension was built.

A lifted call reads every Variable's array, checks that each still holds its
metadata dict and that no attribute dict changed, and writes results back.
In Python each step costs 30-80 ns per object, most of it the attribute
lookup through flax's `Variable.__getattr__` hook; `meshlift._speedups`
calls the slot's descriptor directly, in one C loop per step. Where the
extension was not built (no C compiler at install time), the pure-Python
twins below give the same results. `COMPILED` says which is in use.

Example:

```python
import inspect
from meshlift import speedups

class Box:
    __slots__ = ("item",)

slot = inspect.getattr_static(Box, "item")
boxes = (Box(), Box())
speedups.write_each(slot, boxes, (1, 2))
assert speedups.read_each(slot, boxes) == (1, 2)
assert speedups.read_each_is(slot, boxes, (1, 2))
assert speedups.same_items(({"a": boxes},), (1,), ("a",), (boxes,))
```
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable
from itertools import chain
from typing import Any


def _read_each(descriptor: Any, objects: tuple[Any, ...]) -> tuple[Any, ...]:
    """`descriptor.__get__(o)` for each object, as a tuple."""
    return tuple(map(descriptor.__get__, objects))


def _read_each_is(descriptor: Any, objects: tuple[Any, ...], expected: tuple[Any, ...]) -> bool:
    """Whether `descriptor.__get__(o) is e` for each pair (False if the lengths differ)."""
    return len(objects) == len(expected) and all(
        map(operator.is_, map(descriptor.__get__, objects), expected)
    )


def _write_each(descriptor: Any, objects: tuple[Any, ...], values: tuple[Any, ...]) -> None:
    """`descriptor.__set__(o, v)` for each pair."""
    if len(objects) != len(values):
        raise ValueError(f"write_each(): {len(objects)} objects but {len(values)} values")
    collections.deque(map(descriptor.__set__, objects, values), maxlen=0)


def _same_items(
    dicts: tuple[dict, ...],
    sizes: tuple[int, ...],
    keys: tuple[Any, ...],
    values: tuple[Any, ...],
) -> bool:
    """Whether each dict still has its size and, all together in order, keys equal to `keys`
    holding the very objects in `values`."""
    if len(sizes) != len(dicts) or list(map(len, dicts)) != list(sizes):
        return False
    now: Iterable[Any] = chain.from_iterable(dicts)
    if len(keys) != len(values) or list(now) != list(keys):
        return False
    return all(map(operator.is_, chain.from_iterable(map(dict.values, dicts)), values))


try:
    from meshlift._speedups import read_each, read_each_is, same_items, write_each
except ImportError:  # built without a C compiler: the twins above
    COMPILED = False
    read_each, read_each_is, write_each, same_items = (
        _read_each,
        _read_each_is,
        _write_each,
        _same_items,
    )
else:
    COMPILED = True
