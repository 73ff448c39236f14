"""Static values changed in place inside a trace: noticed, kept or undone, and re-traced.

A static value (a config object, a list, a closure's cell) is compiled into
the program, and the objects a traced function sees are the caller's own.
JAX runs the function's Python once per compile, so a change it makes to one
of them in place (optax's cosine schedule turns its `decay_steps` 8 into 8.0
on first use) would happen on the first call only if the program were
reused. `StaticValues` fingerprints each static value before the function
runs and keeps a shallow copy of every mutable object it reaches; afterwards
`changed()` names what changed and `restore()` puts it back.

A trace hands what it changed to the lifted call in progress (`begin`,
`record`, `end`): a call that succeeds keeps the changes, as eager
execution does, and forgets its program, so the next call traces again and
runs the Python again; a call that fails undoes them; a stage (`trace`,
`lower`, `eval_shape`) writes nothing back, so it undoes them too. A
repeated call on its plan begins nothing (it rarely traces): it notes
`recorded()` before running, and only if that moved does it `adopt` what its
trace recorded, then ends as any call.
"""

from __future__ import annotations

import array
import collections
import contextlib
import contextvars
import functools
import gc
import types
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from meshlift.graph.structure import (
    _BUFFERS,
    _MISSING,
    _cell_contents,
    _slot_names,
    _unchanging,
    fingerprint,
)


class StaticValues:
    """The static values held by some graph nodes, and a shallow copy of every mutable object
    they reach, to notice a change made in place by a trace, and to undo it.

    Example:

    ```python
    from meshlift.call.static_changes import StaticValues

    model = nnx.Module()
    model.sizes, model.steps = [1, 2], {"decay": 8}
    statics = StaticValues((model,))
    model.sizes.append(3)
    model.steps["decay"] = 8.0               # equal under ==: no change
    assert statics.changed() == [(0, "sizes")]
    statics.restore()
    assert model.sizes == [1, 2]
    ```
    """

    def __init__(self, nodes: tuple[Any, ...]):
        self._values = [
            (path, value, fingerprint(value, typed=False)) for path, value in _static_values(nodes)
        ]
        self._copies: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        for _, value, _ in self._values:
            self._copy(value, seen)

    def changed(self) -> list[tuple[Any, ...]]:
        """The paths (top-level position first) of values changed in place since; a number
        that became an equal one of another type (8 and 8.0) is no change."""
        return [
            path
            for path, value, before in self._values
            if fingerprint(value, typed=False) != before
        ]

    def tracer_in(self, paths: list[tuple[Any, ...]]) -> tuple[Any, ...] | None:
        """The path (below the nodes) of a tracer that the values at `paths` now hold (in a
        container, an attribute, a Variable), or None: kept after the trace, it would leak."""
        values = dict((path, value) for path, value, _ in self._values)
        for path in paths:
            found = _tracer_below(values[path])
            if found is not None:
                return (*path, *found)
        return None

    def restore(self) -> bool:
        """Put back what every object held; False if some change could not be undone."""
        for obj, contents in self._copies:
            with contextlib.suppress(Exception):
                _put_back(obj, contents)
        return not self.changed()

    def _copy(self, obj: Any, seen: set[int]) -> None:
        """A shallow copy of `obj` and of each mutable object it reaches."""
        if isinstance(obj, _unchanging()) or id(obj) in seen or graphlib.is_graph_node(obj):
            return
        seen.add(id(obj))
        contents, children = _shallow(obj)
        if contents is not _MISSING:
            self._copies.append((obj, contents))
        for child in children:
            self._copy(child, seen)


# What the traces of the innermost lifted call (or stage) in progress changed in place:
# (the values, the caller's paths that changed), in the order the traces ran.
_TRACED: contextvars.ContextVar[list[tuple[StaticValues, tuple[str, ...]]] | None] = (
    contextvars.ContextVar("meshlift_static_changes", default=None)
)
# What traces changed with no call collecting (a repeated call's, until it adopts them):
# (the count of such records when made, the values, the paths), in this context.
_UNCLAIMED: contextvars.ContextVar[tuple[tuple[int, StaticValues, tuple[str, ...]], ...]] = (
    contextvars.ContextVar("meshlift_unclaimed_static_changes", default=())
)
_RECORDED = [0]  # how many changes traces recorded with no call collecting, in any context


def begin() -> contextvars.Token:
    """Start collecting the changes in place that traces make, until `end`."""
    return _TRACED.set([])


def collecting() -> bool:
    """Whether a lifted call (or stage) in this context collects what traces change."""
    return _TRACED.get() is not None


def recorded() -> int:
    """A count that moves whenever a trace records a change with no call collecting: a
    repeated call compares it before and after running its program."""
    return _RECORDED[0]


def adopt(since: int) -> contextvars.Token:
    """`begin`, holding the changes recorded in this context with no call collecting since
    `recorded()` returned `since` (the repeated call's own trace); older ones, which no
    call made, are undone."""
    mine: list[tuple[StaticValues, tuple[str, ...]]] = []
    for count, values, paths in _UNCLAIMED.get():
        if count > since:
            mine.append((values, paths))
        else:
            values.restore()
    _UNCLAIMED.set(())
    return _TRACED.set(mine)


def record(values: StaticValues, paths: tuple[str, ...]) -> None:
    """A trace changed `values` in place at `paths` (the caller's names): the lifted call in
    progress keeps or undoes it; with none collecting, it waits to be adopted."""
    traced = _TRACED.get()
    if traced is None:
        _RECORDED[0] += 1
        _UNCLAIMED.set((*_UNCLAIMED.get(), (_RECORDED[0], values, paths)))
    else:
        traced.append((values, paths))


def pending() -> tuple[str, ...]:
    """The paths changed in place by the traces of the call in progress so far."""
    traced = _TRACED.get()
    if not traced:  # every call asks: no trace, or none that changed anything
        return ()
    return tuple(path for _, paths in traced for path in paths)


def end(token: contextvars.Token, keep: bool) -> tuple[str, ...]:
    """Stop collecting; undo every change unless `keep`. The paths that could not be
    undone (none if `keep`)."""
    traced = _TRACED.get()
    _TRACED.reset(token)
    if keep or not traced:
        return ()
    stuck: list[str] = []
    for values, paths in reversed(traced):  # the earliest snapshot is put back last
        if not values.restore():
            stuck += paths
    return tuple(stuck)


def _tracer_below(value: Any) -> tuple[Any, ...] | None:
    """The keys from `value` down to a tracer it holds, or None."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    seen: set[int] = set()
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, jax.core.Tracer):
            return path
        if isinstance(obj, _unchanging()) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, nnx.Variable):
            stack += [(leaf, path) for leaf in jax.tree.leaves(obj.get_raw_value())]
        elif isinstance(obj, dict):
            stack += [(v, (*path, k)) for k, v in obj.items()]
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            stack += [(v, (*path, i)) for i, v in enumerate(obj)]
        elif isinstance(getattr(obj, "__dict__", None), dict) and not callable(obj):
            stack += [(v, (*path, k)) for k, v in vars(obj).items()]
    return None


def _static_values(nodes: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, value) of every static attribute below `nodes` that could change in place."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    seen: set[int] = set()
    skip: tuple[type, ...] = (*_unchanging(), nnx.Variable, jax.Array, np.ndarray)

    def visit(node: Any, path: tuple[Any, ...]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        impl: Any = graphlib.get_node_impl(node)
        for key, value in impl.node_dict(node).items():
            if isinstance(key, str) and key.startswith("_pytree__"):
                continue  # flax's bookkeeping
            if isinstance(value, skip):
                continue  # a Variable, an array (data), or immutable
            if graphlib.is_graph_node(value):
                visit(value, (*path, key))
            elif not _holds_data(value):
                found.append(((*path, key), value))

    for i, node in enumerate(nodes):
        if graphlib.is_graph_node(node) and not isinstance(node, nnx.Variable):
            visit(node, (i,))
    return found


def _holds_data(value: Any) -> bool:
    """Whether a pytree attribute holds graph nodes or arrays (flax flattens it: data)."""
    try:
        leaves = jax.tree_util.tree_leaves(value, is_leaf=graphlib.is_graph_node)
    except Exception:  # keys that do not sort, say: not a pytree flax flattens
        return False
    return any(graphlib.is_graph_node(x) or isinstance(x, jax.Array | np.ndarray) for x in leaves)


def _shallow(obj: Any) -> tuple[Any, list[Any]]:
    """What `obj` holds (to put back; `_MISSING` if it cannot change in place), and the
    objects it holds."""
    if isinstance(obj, types.MappingProxyType):
        return _MISSING, [r for r in gc.get_referents(obj) if isinstance(r, dict)]
    if isinstance(obj, types.FunctionType):
        cells = list(obj.__closure__ or ())
        parts = (obj.__code__, obj.__defaults__, obj.__kwdefaults__)
        return parts, [*parts[1:], *cells]
    if isinstance(obj, types.CellType):
        contents = _cell_contents(obj)
        return contents, [contents]
    if isinstance(obj, types.MethodType):
        return _MISSING, [obj.__func__, obj.__self__]
    if isinstance(obj, np.ndarray | array.array):
        return obj[:].copy() if isinstance(obj, np.ndarray) else type(obj)(obj.typecode, obj), []
    if isinstance(obj, _BUFFERS):
        return bytes(memoryview(obj)), []  # a bytearray's or memoryview's bytes
    if isinstance(obj, dict):
        return dict(obj), [*obj.keys(), *obj.values()]
    if isinstance(obj, list | collections.deque | set):
        return type(obj)(obj), list(obj)
    if isinstance(obj, tuple | frozenset):
        return _MISSING, list(obj)
    if isinstance(obj, functools.partial):
        return _MISSING, [obj.func, obj.args, obj.keywords]
    fields = getattr(obj, "__dict__", None)
    slots = {name: getattr(obj, name, _MISSING) for name in _slot_names(type(obj))}
    if not isinstance(fields, dict) and not slots:
        return _MISSING, []
    fields = dict(fields) if isinstance(fields, dict) else None
    return (type(obj), fields, slots), [*(fields or {}).values(), *slots.values()]


def _put_back(obj: Any, contents: Any) -> None:
    """Make `obj` hold `contents` (from `_shallow`) again, in place."""
    if isinstance(obj, types.FunctionType):
        obj.__code__, obj.__defaults__, obj.__kwdefaults__ = contents
    elif isinstance(obj, types.CellType):
        obj.cell_contents = contents
    elif isinstance(obj, np.ndarray):
        obj[...] = contents
    elif isinstance(obj, memoryview):
        obj.cast("B")[:] = contents
    elif isinstance(obj, _BUFFERS):
        obj[:] = contents
    elif isinstance(obj, dict | set):
        obj.clear()
        obj.update(contents)
    elif isinstance(obj, list | collections.deque):
        obj.clear()
        obj.extend(contents)
    else:
        cls, fields, slots = contents
        if type(obj) is not cls:
            obj.__class__ = cls
        if fields is not None and obj.__dict__ != fields:
            obj.__dict__.clear()
            obj.__dict__.update(fields)
        for name, value in slots.items():
            if value is not _MISSING:
                object.__setattr__(obj, name, value)
