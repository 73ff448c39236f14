"""The per-call loops over many objects: in C where meshlift's extension was built.

A lifted call reads every Variable's array, checks that each still holds its
metadata dict and that no attribute dict changed, and writes results back.
In Python each step costs 30-80 ns per object, most of it the attribute
lookup through flax's `Variable.__getattr__` hook; `meshlift._speedups`
calls the slot's descriptor directly, in one C loop per step. A repeated
call runs on a `CallPlan`: `plan_inputs` checks the arguments and reads the
staged function's inputs, `plan_write` writes its outputs back, each in one
C call. Where the extension was not built (no C compiler at install time),
the pure-Python twins below give the same results. `COMPILED` says which
is in use.

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
import weakref
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, NamedTuple


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


def _same_dicts(holders: tuple[Any, ...], dicts: tuple[dict, ...]) -> bool:
    """Whether each holder's attribute dict is the dict at its position; a holder that is
    a `weakref.ref` is read through it (collected: False)."""
    if len(holders) != len(dicts):
        return False
    for holder, attributes in zip(holders, dicts, strict=True):
        if type(holder) is weakref.ref:
            holder = holder()
            if holder is None:
                return False
        if object.__getattribute__(holder, "__dict__") is not attributes:
            return False
    return True


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


class CallPlan(NamedTuple):
    """What a repeated call of one lifted function needs, fixed after a call that succeeded.

    A call matches when `mesh_source()` (if not None) returns `mesh`, its
    arguments have `types`, the graph nodes at `node_positions` are the
    referents of `node_refs`, and `unchanged()`. Its staged inputs are then the
    `slot` of each of `variables` and the arguments at `dyn_positions`, kept
    and donated (the `donated_` fields); no donated input may be another input
    too. Outputs carrying `info` write the Variable outputs at `changed` into
    `targets`, when each is an `array_type`. The C functions read the fields
    by position: keep the order.
    """

    mesh_source: Callable[[], Any] | None
    mesh: Any
    types: tuple[type, ...]
    node_positions: tuple[int, ...]
    node_refs: tuple[Callable[[], Any], ...]
    unchanged: Callable[[], bool]
    slot: Any
    variables: tuple[Any, ...]
    dyn_positions: tuple[int, ...]
    donated_variables: tuple[Any, ...]
    donated_dyn_positions: tuple[int, ...]
    info: Any
    changed: tuple[int, ...]
    targets: tuple[Any, ...]
    array_type: type
    staged: Callable[..., Any]  # read in Python only, from here on
    entry: Any


def donated_alone(inputs: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether, of the staged function's four inputs (kept Variables, kept other
    arguments, donated Variables, donated other arguments), the donated objects are
    distinct and none is also kept: JAX cannot donate one buffer twice, nor read a
    buffer it donated."""
    kept_vars, kept_dyn, donated_vars, donated_dyn = inputs
    donated = [*donated_vars, *donated_dyn]
    ids = set(map(id, donated))
    return len(ids) == len(donated) and ids.isdisjoint(map(id, (*kept_vars, *kept_dyn)))


def _plan_inputs(plan: CallPlan, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...] | None:
    """The staged function's four inputs for a call with `args` that matches `plan`, else None."""
    if plan.mesh_source is not None:
        try:
            mesh = plan.mesh_source()
        except Exception:  # the general path asks again, and names the error if it recurs
            return None
        if mesh is not plan.mesh:
            return None
    if len(args) != len(plan.types) or not all(map(operator.is_, map(type, args), plan.types)):
        return None
    for position, ref in zip(plan.node_positions, plan.node_refs, strict=True):
        if args[position] is not ref():
            return None
    if not plan.unchanged():
        return None
    inputs = (
        read_each(plan.slot, plan.variables),
        tuple(map(args.__getitem__, plan.dyn_positions)),
        read_each(plan.slot, plan.donated_variables),
        tuple(map(args.__getitem__, plan.donated_dyn_positions)),
    )
    if (inputs[2] or inputs[3]) and not donated_alone(inputs):
        return None  # the general path names the shared array
    return inputs


def _plan_write(plan: CallPlan, outputs: Any) -> bool:
    """Write the staged `outputs` back as `plan` says; False, writing nothing, if they do
    not carry its trace info or a value is not an `array_type` (a tracer, say)."""
    if type(outputs) is not tuple or len(outputs) != 4:
        return False
    var_out, _, _, aux = outputs
    if getattr(aux, "info", None) is not plan.info or type(var_out) is not tuple:
        return False
    try:
        new = tuple(map(var_out.__getitem__, plan.changed))
    except IndexError:
        return False
    if not all(type(value) is plan.array_type for value in new):
        return False
    write_each(plan.slot, plan.targets, new)
    return True


try:
    from meshlift._speedups import (
        plan_inputs,
        plan_write,
        read_each,
        read_each_is,
        same_dicts,
        same_items,
        write_each,
    )
except ImportError:  # built without a C compiler: the twins above
    COMPILED = False
    read_each, read_each_is, write_each, same_dicts, same_items, plan_inputs, plan_write = (
        _read_each,
        _read_each_is,
        _write_each,
        _same_dicts,
        _same_items,
        _plan_inputs,
        _plan_write,
    )
else:
    COMPILED = True

# The loops with a Python twin `_<name>` above (the C ones when compiled).
LOOPS = (
    "read_each",
    "read_each_is",
    "write_each",
    "same_dicts",
    "same_items",
    "plan_inputs",
    "plan_write",
)
