"""The per-call loops over many objects: in C where meshlift's extension was built.

A lifted call reads every Variable's array, checks that each still holds its
metadata dict and that no attribute dict changed, and writes results back.
In Python each step costs 30-80 ns per object, most of it the attribute
lookup through flax's `Variable.__getattr__` hook; `meshlift._speedups`
calls the slot's descriptor directly, in one C loop per step. A repeated
call runs on a `CallPlan`, whose fields C reads by name: `plan_inputs`
checks the arguments and reads the staged function's inputs, `plan_write`
writes its outputs back, each in one C call (`plan_matches` only checks).
Where the extension was not built (no C compiler at install time), the
pure-Python twins below give the same results. `COMPILED` says which is in
use.

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


def _same_structure(
    holders: tuple[Any, ...],
    held: tuple[dict, ...],
    typed: tuple[Any, ...],
    types: tuple[type, ...],
    slot: Any,
    variables: tuple[Any, ...],
    metadata: tuple[Any, ...],
    dicts: tuple[dict, ...],
    versions: tuple[int, ...],
) -> bool:
    """Whether each holder holds its attribute dict (`same_dicts`), each of `typed` is still
    of its type, each of `variables` holds the `metadata` at its position in `slot` (None:
    not read), and each of `dicts` has its version tag (`dict_versions`, read in C)."""
    return (
        _same_dicts(holders, held)
        and len(typed) == len(types)
        and all(map(operator.is_, map(type, typed), types))
        and (slot is None or _read_each_is(slot, variables, metadata))
        and ((not dicts and not versions) or dict_versions(dicts) == versions)
    )


def _dict_versions(dicts: tuple[dict, ...]) -> tuple[int, ...]:
    """Each dict's version tag (PEP 509): CPython 3.11's, read by the C extension only."""
    raise NotImplementedError("dict_versions(): read by meshlift's C extension only")


_PLAN_FIELDS = (
    "mesh_source",
    "mesh",
    "types",
    "node_positions",
    "node_refs",
    "unchanged",
    "slot",
    "variables",
    "dyn_positions",
    "donated_variables",
    "donated_dyn_positions",
    "info",
    "changed",
    "targets",
    "array_type",
    "staged",
    "entry",
)
_PLAN_TUPLES = (
    "types",
    "node_positions",
    "node_refs",
    "variables",
    "dyn_positions",
    "donated_variables",
    "donated_dyn_positions",
    "changed",
    "targets",
)


class CallPlan:
    """What a repeated call of one lifted function needs, fixed after a call that succeeded.

    A call matches when its arguments have `types`, the graph nodes at
    `node_positions` are the referents of `node_refs`, and `unchanged()`; it
    then runs `entry` without a lookup. Where `slot` is not None, a matching
    call whose `mesh_source()` (if not None) returns `mesh` runs in two C steps:
    its staged inputs are the `slot` of each of `variables` and the arguments
    at `dyn_positions`, kept and donated (the `donated_` fields), no donated
    input being another input too; outputs carrying `info` (None: never) write
    the Variable outputs at `changed` into `targets`, when each is an
    `array_type`. Made by keyword, read-only; where the extension is built this
    is its C type, whose functions read the fields by name.
    """

    __slots__ = _PLAN_FIELDS

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
    staged: Callable[..., Any]
    entry: Any

    def __init__(self, **fields: Any):
        if set(fields) != set(_PLAN_FIELDS):
            raise TypeError(
                f"CallPlan() takes its {len(_PLAN_FIELDS)} fields by keyword, each once"
            )
        for name in _PLAN_TUPLES:
            if type(fields[name]) is not tuple:
                kind = type(fields[name]).__name__
                raise TypeError(f"CallPlan(): {name} must be a tuple, not {kind}")
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CallPlan.{name} is read-only")


_CallPlan = CallPlan  # the pure-Python twin, by this name also where the C type is in use


def donated_alone(inputs: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether, of the staged function's four inputs (kept Variables, kept other
    arguments, donated Variables, donated other arguments), the donated objects are
    distinct and none is also kept: JAX cannot donate one buffer twice, nor read a
    buffer it donated."""
    kept_vars, kept_dyn, donated_vars, donated_dyn = inputs
    donated = [*donated_vars, *donated_dyn]
    ids = set(map(id, donated))
    return len(ids) == len(donated) and ids.isdisjoint(map(id, (*kept_vars, *kept_dyn)))


def _plan_matches(plan: CallPlan, args: tuple[Any, ...]) -> bool:
    """Whether a call with `args` may run `plan.entry`: the same argument types, the same
    graph nodes, their structure unchanged."""
    if len(args) != len(plan.types) or not all(map(operator.is_, map(type, args), plan.types)):
        return False
    for position, ref in zip(plan.node_positions, plan.node_refs, strict=True):
        if position >= len(args) or args[position] is not ref():
            return False
    return bool(plan.unchanged())


def _plan_inputs(plan: CallPlan, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...] | None:
    """The staged function's four inputs for a call with `args` that matches `plan` on the
    mesh in context, else None (also where `plan.slot` is None: it cannot read them)."""
    if plan.slot is None:
        return None
    if plan.mesh_source is not None:
        try:
            mesh = plan.mesh_source()
        except Exception:  # the general path asks again, and names the error if it recurs
            return None
        if mesh is not plan.mesh:
            return None
    if not _plan_matches(plan, args):
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
    not carry its trace info (None: the plan writes nothing) or a value is not an
    `array_type` (a tracer, say)."""
    if plan.info is None or type(outputs) is not tuple or len(outputs) != 4:
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
    from meshlift._speedups import CallPlan as _CompiledCallPlan
    from meshlift._speedups import (
        dict_versions,
        plan_inputs,
        plan_matches,
        plan_write,
        read_each,
        read_each_is,
        same_dicts,
        same_items,
        same_structure,
        write_each,
    )
except ImportError:  # built without a C compiler: the twins above
    COMPILED = False
    read_each, read_each_is, write_each, same_dicts, same_items = (
        _read_each,
        _read_each_is,
        _write_each,
        _same_dicts,
        _same_items,
    )
    same_structure, dict_versions = _same_structure, _dict_versions
    plan_matches, plan_inputs, plan_write = _plan_matches, _plan_inputs, _plan_write
else:
    COMPILED = True
    CallPlan = _CompiledCallPlan  # type: ignore[misc]  # the same fields, read by name in C

# The loops with a Python twin `_<name>` above (the C ones when compiled).
LOOPS = (
    "read_each",
    "read_each_is",
    "write_each",
    "same_dicts",
    "same_items",
    "same_structure",
    "plan_matches",
    "plan_inputs",
    "plan_write",
)
