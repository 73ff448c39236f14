"""Structure: what a compiled program depends on besides arrays, and noticing when it changes.

`fingerprint` is a compile key read from an object's contents, never its
identity, so a fresh `optax.adam(1e-3)` reuses compiled code and a config
object mutated in place does not. `Watcher` takes a snapshot of every
mutable container reachable from a call's graph nodes (attribute dicts,
lists, deques, sets, slots, `partial` keywords, Variable metadata; static
NumPy arrays and byte buffers by contents) and tells, cheaply and mostly by
identity, whether any of it was changed since.

Example:

```python
import optax
from meshlift.graph.structure import fingerprint

assert fingerprint(optax.adam(1e-3)) == fingerprint(optax.adam(1e-3))
assert fingerprint(optax.adam(1e-3)) != fingerprint(optax.adam(1e-2))
```
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import enum
import functools
import gc
import operator
import types
import weakref
from collections.abc import Callable, Hashable, Iterable
from itertools import chain
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from meshlift import compat, speedups
from meshlift.graph import dict_watch

_T = TypeVar("_T")

# Immutable values compared by value.
_ATOMS = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis), type, enum.Enum)
# Mutable buffers: compared by their bytes.
_BUFFERS = (bytearray, array.array, memoryview)
# Compared as themselves: code, and flax's immutable mappings (replaced, never mutated).
_OPAQUE = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    types.CodeType,
    graphlib.HashableMapping,
)


def per_type(fun: Callable[[type], _T]) -> Callable[[type], _T]:
    """`functools.cache` for a function of a class (typed so: checkers count no class Hashable)."""
    return functools.cache(fun)


def fingerprint(x: Any, typed: bool = True) -> Hashable:
    """A hashable key, equal for objects with equal contents, independent of identity.

    Functions compare by code and closed-over values; plain objects, slotted
    objects and dataclasses by their fields; containers by their items (sets
    as sets); objects with their own `__eq__` and `__hash__` as themselves.
    Numbers and strings compare by type and value, as `jax.jit` keys a static
    argument (`1`, `True` and `1.0` differ); with `typed=False` by value
    alone, as `==` compares them.
    """
    return _fingerprint(x, set(), typed)


def _fingerprint(x: Any, active: set[int], typed: bool = True) -> Hashable:
    if isinstance(x, _ATOMS):
        return (type(x), x) if typed else x
    if id(x) in active:  # a cycle, e.g. a recursive closure
        return ("cycle", type(x))
    active.add(id(x))
    try:
        return _fingerprint_compound(x, active, typed)
    finally:
        active.discard(id(x))


def _cell_fingerprint(cell: types.CellType, active: set[int], typed: bool) -> Hashable:
    try:
        return _fingerprint(cell.cell_contents, active, typed)
    except ValueError:  # a name the function uses but that is not assigned yet
        return ("empty cell",)


def _fingerprint_compound(x: Any, active: set[int], typed: bool) -> Hashable:
    fp = functools.partial(_fingerprint, active=active, typed=typed)
    cls = type(x)
    if isinstance(x, list | tuple):
        return (cls, tuple(map(fp, x)), _fields(x, fp))
    if isinstance(x, collections.deque):
        return (cls, x.maxlen, tuple(map(fp, x)))
    if isinstance(x, _BUFFERS):
        return (cls, getattr(x, "typecode", None), _buffer_contents(x))
    if isinstance(x, graphlib.HashableMapping):  # flax's (Variable metadata): its order is
        return (cls, frozenset((fp(k), fp(v)) for k, v in x.items()))  # no part of it
    if isinstance(x, dict | types.MappingProxyType):
        extra = fp(getattr(x, "default_factory", None))
        return (cls, tuple((fp(k), fp(v)) for k, v in x.items()), extra)
    if isinstance(x, set | frozenset):
        return (cls, frozenset(map(fp, x)))
    if isinstance(x, types.FunctionType):
        cells = tuple(_cell_fingerprint(c, active, typed) for c in x.__closure__ or ())
        return (types.FunctionType, x.__code__, cells, fp(x.__defaults__), fp(x.__kwdefaults__))
    if isinstance(x, functools.partial):
        return (functools.partial, fp(x.func), fp(x.args), fp(x.keywords))
    if isinstance(x, types.MethodType):
        return (types.MethodType, fp(x.__func__), fp(x.__self__))
    if isinstance(x, np.ndarray | np.generic):
        return (cls, x.shape, str(x.dtype), np.asarray(x).tobytes())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (cls, tuple(fp(getattr(x, f.name, None)) for f in dataclasses.fields(x)))
    if (isinstance(x, _OPAQUE) or _has_value_equality(cls)) and _hashable(x):
        return x
    fields = _fields(x, fp)
    if fields is not None:
        return (cls, fields)
    return x if _hashable(x) else _Identity(x)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except Exception:  # TypeError, or what a __hash__ of its own raises
        return False
    return True


def _fields(x: Any, fp: Any) -> Hashable | None:
    """The contents of `x`'s `__dict__` and slots, fingerprinted; None if it has neither."""
    attributes = getattr(x, "__dict__", None)
    names = _slot_names(type(x))
    if not isinstance(attributes, dict) and not names:
        return None
    items = tuple((k, fp(v)) for k, v in (attributes or {}).items())
    return items + tuple((name, fp(getattr(x, name, _MISSING))) for name in names)


@per_type
def _has_value_equality(cls: type) -> bool:
    return cls.__eq__ is not object.__eq__ and cls.__hash__ is not None


def _holds_static_values(obj: Any) -> bool:
    """Whether flax keeps what `obj` holds as static: `obj` is neither a graph node nor a
    JAX pytree node (a list, dict, tuple or registered class), whose leaves are data."""
    if graphlib.is_graph_node(obj) or isinstance(obj, dict | list | tuple):
        return False
    try:
        leaves = jax.tree_util.tree_leaves(obj, is_leaf=lambda x: x is not obj)
    except Exception:  # a pytree node whose keys do not sort, say: not a leaf
        return False
    return len(leaves) == 1 and leaves[0] is obj


def _buffer_contents(buffer: Any) -> Hashable:
    """What a buffer holds now: a NumPy array's shape, dtype and bytes; another's bytes
    (a memoryview's with its format and shape)."""
    if isinstance(buffer, np.ndarray):
        return (buffer.shape, buffer.dtype.str, buffer.tobytes())
    try:
        view = memoryview(buffer)
        return (view.format, view.shape, view.tobytes())
    except ValueError:  # a released memoryview
        return ("released",)


@per_type
def _has_generic_dict(cls: type) -> bool:
    """Whether `obj.__dict__` of a `cls` is the interpreter's own slot (no property)."""
    for klass in cls.__mro__:
        descriptor = vars(klass).get("__dict__")
        if descriptor is not None:
            return isinstance(descriptor, types.GetSetDescriptorType | types.MemberDescriptorType)
    return False


@per_type
def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


@functools.cache
def _unchanging() -> tuple[type, ...]:
    """Types of objects that are not looked into for changes made in place: values, code,
    modules, flax's bookkeeping. (Functions and methods are: their defaults and cells.)"""
    opaque = tuple(t for t in _OPAQUE if t not in (types.FunctionType, types.MethodType))
    return _ATOMS + opaque + compat.bookkeeping_types()


_FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")
# Whose functions a model holds as constants, never changed in place: not watched per call.
_LIBRARIES = frozenset({"jax", "jaxlib", "flax", "optax", "numpy"})


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not assigned yet
        return _MISSING


@per_type
def _builtin_type(cls: type) -> bool:
    """Whether `cls` is a type of the interpreter's own, whose instances keep their class."""
    return cls.__module__ == "builtins"


class _Missing:
    def __repr__(self) -> str:
        return "<unset slot>"


_MISSING = _Missing()


class _Identity:
    """Compares by identity; keeps its object alive so the id is never reused.

    The last resort for an unhashable object with no readable contents.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class _Snapshot:
    """The identity of every item of some dicts, sequences, sets and slots, and the contents
    of some buffers (a static NumPy array, a `bytearray`); `same()` compares them.

    This is on the per-call path: plain dicts, nearly all of it, are compared
    in one `speedups.same_items` loop; the rest in loops that run in C too.
    """

    def __init__(
        self,
        dicts: list[dict],
        sequences: list[Any],
        sets: list[set],
        slotted: list[tuple[Any, tuple[str, ...]]],
        buffers: list[Any],
    ):
        self._plain = tuple(d for d in dicts if type(d) is dict)
        # a dict subclass may iterate otherwise (an OrderedDict keeps its own order)
        self._dicts = [d for d in dicts if type(d) is not dict]
        self._sequences, self._sets, self._buffers = sequences, sets, buffers
        # A function's parts and a cell's contents: read by descriptor, many in one C loop.
        described: dict[Any, list[Any]] = {}
        self._slotted: list[tuple[Any, tuple[str, ...]]] = []
        for obj, names in slotted:
            if type(obj) in (types.FunctionType, types.CellType):
                for name in names:
                    described.setdefault(type(obj).__dict__[name], []).append(obj)
            else:
                self._slotted.append((obj, names))
        self._described = tuple((d, tuple(objects)) for d, objects in described.items())
        self._sized = [*self._dicts, *sequences, *sets]
        self.empty = not dicts and not self._sized and not slotted and not buffers
        self.take()

    def take(self) -> None:
        plain = self._plain
        self._plain_sizes = tuple(map(len, plain))
        self._plain_keys = tuple(chain.from_iterable(plain))
        self._plain_values = tuple(chain.from_iterable(map(dict.values, plain)))
        self._sizes = list(map(len, self._sized))
        self._keys = list(chain.from_iterable(self._dicts))
        self._values = list(self._value_stream())
        self._set_copies = [frozenset(s) for s in self._sets]
        self._buffer_copies = list(map(_buffer_contents, self._buffers))
        self._described_values = self._read_described()

    def same(self) -> bool:
        if not speedups.same_items(
            self._plain, self._plain_sizes, self._plain_keys, self._plain_values
        ):
            return False
        if self._buffers and list(map(_buffer_contents, self._buffers)) != self._buffer_copies:
            return False
        if self._described and not self._same_described():
            return False
        if not self._sized and not self._slotted:
            return True
        if list(map(len, self._sized)) != self._sizes:
            return False
        # Keys are names, so equality is right (and fast); values must be the same objects.
        # Lengths are equal, so the value streams line up one to one.
        if list(chain.from_iterable(self._dicts)) != self._keys:
            return False
        if not all(map(operator.is_, self._value_stream(), self._values)):
            return False
        return not self._sets or all(
            frozenset(s) == copy for s, copy in zip(self._sets, self._set_copies, strict=True)
        )

    def _read_described(self) -> tuple[tuple[Any, ...], ...] | None:
        try:
            return tuple(speedups.read_each(d, objects) for d, objects in self._described)
        except ValueError:  # a cell emptied (`del` of a closure variable): a change
            return None

    def _same_described(self) -> bool:
        values = self._described_values
        try:
            return values is not None and all(
                speedups.read_each_is(d, objects, before)
                for (d, objects), before in zip(self._described, values, strict=True)
            )
        except ValueError:
            return False

    def _value_stream(self) -> Iterable[Any]:
        """Every watched value but the plain dicts' in a fixed order: dict values,
        sequence items, slots."""
        values = chain(
            chain.from_iterable(map(dict.values, self._dicts)),
            chain.from_iterable(self._sequences),
        )
        if not self._slotted:
            return values
        slots = (getattr(obj, name, _MISSING) for obj, names in self._slotted for name in names)
        return chain(values, slots)


class Watcher:
    """A snapshot of the mutable containers that fix the structure of `nodes`.

    `unchanged()` is true while no attribute of any node was added, removed
    or replaced, no object's attribute dict was swapped for another, no
    watched dict, list, deque, set, slot or static buffer changed, and no
    Variable's metadata changed: identity checks and a few equality checks,
    no traversal.

    Plain dicts (attribute dicts, Variable metadata) tell of their own
    changes where they can: through dict watchers (`dict_watch.available()`,
    CPython 3.12) or their version tags (`dict_watch.versions_available()`,
    CPython 3.11). Then, while none changed, the check reads only lists, sets,
    slots, each object's class and attribute dict and which metadata dict each
    Variable holds, in one C call (`speedups.same_structure`): its cost no
    longer grows with the number of attributes. Elsewhere every item is
    compared by identity, in C (`speedups.same_items`), metadata dicts too; a
    Variable's metadata is compared by value only when one of those differs,
    so equal metadata set anew is no change. Which of the two `unchanged` is,
    is chosen once, when the watcher is made.
    """

    def __init__(self, nodes: Any):
        self._typed: list[Any] = []  # objects whose class may be swapped (`obj.__class__ = ...`)
        slots = compat.variable_slots()
        self._metadata_slot = None if slots is None else slots.metadata
        self._read_metadata: Callable[[Any], Any] = (
            operator.methodcaller("get_metadata") if slots is None else slots.metadata.__get__
        )
        self._dicts: list[dict] = []
        self._sequences: list[Any] = []
        self._sets: list[set] = []
        self._slotted: list[tuple[Any, tuple[str, ...]]] = []
        self._variables: list[Any] = []
        self._buffers: list[Any] = []
        self._holders: list[Any] = []  # objects, a top-level node through a weakref
        self._held: list[dict] = []  # the attribute dict each holds
        self._root_ids = {id(node) for node in nodes}
        self._skip = _unchanging()
        self._watch(nodes, set())
        self._typed_tuple = tuple(self._typed)
        self._types = tuple(map(type, self._typed))
        self._variable_tuple = tuple(self._variables)
        self._holder_tuple, self._held_tuple = tuple(self._holders), tuple(self._held)
        containers = (self._sequences, self._sets, self._slotted, self._buffers)
        self._everything = _Snapshot(self._dicts, *containers)
        self._by_watchers = slots is not None and dict_watch.available()
        self._by_versions = (
            slots is not None and not self._by_watchers and dict_watch.versions_available()
        )
        self._told = self._by_watchers or self._by_versions  # plain dicts tell of changes
        # Dict subclasses (an OrderedDict keeps its order outside its dict) are compared.
        self._plain = tuple(d for d in self._dicts if type(d) is dict)
        if self._by_watchers:
            dict_watch.watch(self._plain)
        if self._told:
            unwatched = [d for d in self._dicts if type(d) is not dict]
            self._unwatched = _Snapshot(unwatched, *containers)
        self._metadata_dicts: tuple[Any, ...] = ()
        self.snapshot()
        # The check, chosen once: told by the dicts themselves, or by comparing everything.
        self.unchanged: Callable[[], bool] = (
            self._unchanged_as_told if self._told else self._unchanged_by_comparing
        )

    def snapshot(self) -> None:
        """Take the current state as the unchanged one (after meshlift itself wrote to it)."""
        self._seen, self._quick = self._arm()
        if self._told:
            self._unwatched.take()
        self._everything.take()
        self._metadata = [dict(self._read_metadata(v)) for v in self._variables]

    def _same_holders(self) -> bool:
        """Whether every object holds the attribute dict and has the class it had:
        `obj.__dict__ = {...}` swaps in a dict the snapshot and watchers do not hold, and
        `obj.__class__ = ...` changes a Variable's type or a configuration's class."""
        holders = (self._holder_tuple, self._held_tuple, self._typed_tuple, self._types)
        return speedups.same_structure(*holders, None, (), (), (), ())

    def _unchanged_by_comparing(self) -> bool:
        if not self._same_holders() or not self._everything.same():
            return False
        if self._same_metadata_items():
            return True  # the same objects everywhere
        if self._metadata_same():  # equal metadata, new objects
            self._arm()
            return True
        return False

    def _unchanged_as_told(self) -> bool:
        if (
            self._seen == dict_watch.changes()
            and self._metadata_watched
            and (self._unwatched.empty or self._unwatched.same())
            and speedups.same_structure(*self._quick)
        ):
            return True  # no plain dict changed, nor anything they cannot tell of
        if not self._same_holders():
            return False
        # Something changed, maybe back to what it was: compare everything.
        armed = self._arm()  # before comparing, so that a change while comparing is seen
        if self._everything.same() and self._metadata_same():
            self._seen, self._quick = armed
            return True
        return False

    def _same_metadata_items(self) -> bool:
        """Whether each Variable holds the metadata dict it held when last armed, with the
        same items (without dict watchers)."""
        items = self._metadata_items
        return items is not None and self._same_metadata_dicts() and items.same()

    def _same_metadata_dicts(self) -> bool:
        """Whether each Variable holds the metadata dict it held when last armed."""
        if self._metadata_slot is None:
            held = map(self._read_metadata, self._variable_tuple)
            return all(map(operator.is_, held, self._metadata_dicts))
        return speedups.read_each_is(
            self._metadata_slot, self._variable_tuple, self._metadata_dicts
        )

    def _arm(self) -> tuple[float, tuple[Any, ...]]:
        """Note the metadata dict each Variable holds now, so that a change to one is seen:
        watch it (dict watchers), else snapshot its items. The change count after that, and
        the arguments of `speedups.same_structure` that check what plain dicts cannot tell
        (with their version tags now, where they tell by those)."""
        current = tuple(map(self._read_metadata, self._variable_tuple))
        if self._by_watchers:
            before = self._metadata_dicts or (None,) * len(current)
            fresh = (d for d, old in zip(current, before, strict=True) if d is not old)
            dict_watch.watch(d for d in fresh if type(d) is dict)
        if self._told:
            self._metadata_watched = all(type(d) is dict for d in current)
        else:  # only dicts are compared item by item; anything else, by value every call
            every_dict = all(isinstance(d, dict) for d in current)
            self._metadata_items = _Snapshot(list(current), [], [], [], []) if every_dict else None
        self._metadata_dicts = current
        tagged = (*self._plain, *current) if self._by_versions and self._metadata_watched else ()
        quick = (
            *(self._holder_tuple, self._held_tuple, self._typed_tuple, self._types),
            *(self._metadata_slot, self._variable_tuple, current),
            *(tagged, speedups.dict_versions(tagged) if tagged else ()),
        )
        return dict_watch.changes(), quick

    def _metadata_same(self) -> bool:
        # Metadata values are plain data (names, specs, meshes), read afresh from each
        # Variable: equal means the same structure. Mutable ones are watched as well.
        try:
            return list(map(self._read_metadata, self._variables)) == self._metadata
        except Exception:  # an array in the metadata compared elementwise: call it changed
            return False

    def _hold(self, obj: Any, attributes: dict) -> None:
        """Note that `obj` holds `attributes`, to see it swapped for another dict later (by
        `obj.__dict__ = ...`)."""
        if not _has_generic_dict(type(obj)) or obj.__dict__ is not attributes:
            return
        holder = obj
        if id(obj) in self._root_ids:
            # Held weakly: the layout cache drops a layout once a node it was made for dies.
            # (The other objects are held anyway, by the containers watched above them.)
            with contextlib.suppress(TypeError):  # else no weak references to it
                holder = weakref.ref(obj)
        self._holders.append(holder)
        self._held.append(attributes)

    def _watch(self, obj: Any, seen: set[int], static: bool = False) -> None:
        """Note every mutable container reachable from `obj`; `static`: `obj` is held by a
        static value (not reached through graph nodes and pytrees alone), so an array there
        is a compile-time constant, not data."""
        if isinstance(obj, self._skip) or id(obj) in seen:
            return
        seen.add(id(obj))
        if id(obj) not in self._root_ids and not _builtin_type(type(obj)):
            self._typed.append(obj)  # a top-level node's type is part of the layout's key
        if isinstance(obj, nnx.Variable):
            self._variables.append(obj)  # its metadata is compared by value, see unchanged()
            for value in self._read_metadata(obj).values():
                self._watch(value, seen, static=True)
            return
        if isinstance(obj, _BUFFERS) or (static and isinstance(obj, np.ndarray)):
            self._buffers.append(obj)
            return
        if hasattr(obj, "shape") and hasattr(obj, "dtype"):  # an array: data, or immutable
            return
        children: Iterable[Any] = ()
        if isinstance(obj, types.MappingProxyType):  # watch the dict it shows
            children = [r for r in gc.get_referents(obj) if isinstance(r, dict)]
        elif isinstance(obj, types.MethodType):
            children = (obj.__func__, obj.__self__)
        elif isinstance(obj, types.FunctionType):  # what the fingerprint reads of it
            if obj.__module__ and obj.__module__.partition(".")[0] in _LIBRARIES:
                return  # jax's, flax's own functions (a Linear's dot_general): not watched
            self._slotted.append((obj, _FUNCTION_PARTS))
            cells = [cell for cell in obj.__closure__ or () if _cell_contents(cell) is not _MISSING]
            self._slotted += [(cell, ("cell_contents",)) for cell in cells]
            children = [obj.__defaults__, obj.__kwdefaults__, *map(_cell_contents, cells)]
        elif isinstance(obj, dict):
            self._dicts.append(obj)
            children = [*obj.keys(), *obj.values()]  # a key may be an object changed in place
        elif isinstance(obj, list | collections.deque):
            self._sequences.append(obj)
            children = list(obj)
        elif isinstance(obj, set):
            self._sets.append(obj)
            children = list(obj)
        elif isinstance(obj, tuple | frozenset):
            children = obj
        elif isinstance(obj, functools.partial):
            children = (obj.func, obj.args, obj.keywords)
        attributes = getattr(obj, "__dict__", None)
        if isinstance(obj, types.FunctionType):
            attributes = None  # the fingerprint reads a function's code, defaults and cells
        if isinstance(attributes, dict) and not isinstance(obj, type):
            self._dicts.append(attributes)
            self._hold(obj, attributes)
            children = chain(children, list(attributes.values()))
        names = _slot_names(type(obj))
        if names:
            self._slotted.append((obj, names))
            children = chain(children, [getattr(obj, n, _MISSING) for n in names])
        static = static or _holds_static_values(obj)
        for child in children:
            self._watch(child, seen, static)
