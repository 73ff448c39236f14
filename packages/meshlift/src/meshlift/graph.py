"""Split and merge: NNX graph nodes in an argument tree <-> a flat tuple of arrays.

``GraphSplit`` flattens the graph nodes of a call's arguments once and keeps
that plan while their structure is unchanged. Per call it only gathers the
arrays out of the ``Variable`` objects and scatters new ones back, which is
what makes a lifted call cost about as much as ``jax.jit`` over a list of
arrays. Inside the traced function, ``rebuild`` makes fresh objects around the
tracers, so the user's function sees ordinary modules.

Example::

    split = GraphSplit((model, optimizer))
    arrays = split.gather()                 # one array per Variable, shared ones once
    assert split.unchanged()                # cheap: identity checks only
    split.scatter(range(len(arrays)), arrays)
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
from collections.abc import Hashable, Iterable, Sequence
from itertools import chain
from typing import Any

import flax
from flax import nnx
from flax.nnx import graphlib

from meshlift.sharding import format_path

# The fast path reads and writes the slot where flax keeps a Variable's array,
# skipping get_value()'s copy and hooks. It is pinned to the flax versions it
# was tested on; any other version goes through the public API.
FAST_PATH_FLAX_VERSIONS = frozenset({"0.12.8"})
_read_raw = operator.attrgetter("_raw_value")
_read_metadata = operator.attrgetter("_var_metadata")
_write_raw = nnx.Variable._raw_value.__set__  # type: ignore[attr-defined]


def is_graph_leaf(x: Any) -> bool:
    """True for what split/merge handles: NNX graph nodes (modules, optimizers, Rngs) and Variables."""
    return _is_graph_type(type(x))


@functools.cache
def _is_graph_type(cls: type) -> bool:
    # Cached per type: isinstance through flax's metaclass is slow on the per-call path.
    # Node types register when their class is created, before any instance reaches here.
    return issubclass(cls, nnx.Variable) or cls in graphlib.GRAPH_REGISTRY


def variable_paths(node: Any) -> list[tuple[tuple[Hashable, ...], Any]]:
    """(path, Variable) for every path of ``node``: a shared Variable or module once per path.

    Example::

        model.head = model.embed                   # tied
        [p for p, _ in variable_paths(model)]      # [('embed', 'embedding'), ('head', 'embedding')]
    """
    _, flat = nnx.graph.flatten(node)
    first_paths = list(zip(flat.paths, flat.leaves, strict=True))
    pairs = list(first_paths)
    if isinstance(node, nnx.Variable):
        return pairs
    for group in nnx.graph.find_duplicates(node):
        first, *others = (tuple(p) for p in group)
        for path, variable in first_paths:
            if path[: len(first)] == first:
                pairs += [((*other, *path[len(first) :]), variable) for other in others]
    return pairs


class StructureChangedError(RuntimeError):
    """The lifted function changed the structure of a module it was given."""


class GraphSplit:
    """The flat view of a tuple of graph nodes: their Variables in a fixed order.

    Shared Variables appear once. ``key`` is a structural fingerprint of the
    nodes (types, static attributes, Variable metadata) that does not depend on
    object identity, so two models of the same structure share compiled code.
    """

    def __init__(self, nodes: tuple[Any, ...]):
        self.nodes = nodes
        self._ref_index = graphlib.RefMap()
        self.graphdef, flat = nnx.graph.flatten(nodes, ref_index=self._ref_index)
        self.paths: tuple[tuple[Hashable, ...], ...] = tuple(flat.paths)
        self.variables: tuple[Any, ...] = tuple(flat.leaves)
        self.key = fingerprint(self.graphdef)
        pinned = flax.__version__ in FAST_PATH_FLAX_VERSIONS
        self.fast = pinned and all(
            isinstance(v, nnx.Variable) and not v.hijax and not v.ref for v in self.variables
        )
        # get_metadata() copies; the pinned versions can read the dict itself.
        self._read_metadata = _read_metadata if pinned else operator.methodcaller("get_metadata")
        self._dicts, self._lists, self._watched_variables = _mutable_containers(nodes)
        self._containers = [*self._dicts, *self._lists]
        self._lengths = list(map(len, self._containers))
        self._keys, self._values = self._contents()
        self._metadata_copies = [dict(self._read_metadata(v)) for v in self._watched_variables]

    # -- per call ---------------------------------------------------------
    def unchanged(self) -> bool:
        """True if no attribute of any node was added, removed or replaced since the split."""
        if list(map(len, self._containers)) != self._lengths:
            return False
        keys, values = self._contents()
        # Keys are names, so equality is right (and fast); values must be the same objects.
        if keys != self._keys or not all(map(operator.is_, values, self._values)):
            return False
        # Variable metadata holds plain data (names, specs, meshes): equal means same structure.
        try:
            return list(map(self._read_metadata, self._watched_variables)) == self._metadata_copies
        except Exception:  # an array in the metadata compared elementwise: call it changed
            return False

    def gather(self) -> tuple[Any, ...]:
        """The current array of every Variable, in split order."""
        if self.fast:
            return tuple(map(_read_raw, self.variables))
        return tuple(nnx.graph.flatten(self.nodes, with_paths=False)[1])

    def scatter(self, indices: Iterable[int], values: Sequence[Any]) -> None:
        """Write ``values[i]`` into Variable ``i`` for each index."""
        if self.fast:
            variables = self.variables
            for i in indices:
                _write_raw(variables[i], values[i])
            return
        for i in indices:
            leaf = self.variables[i]
            if isinstance(leaf, nnx.Variable):
                leaf.set_raw_value(values[i])
            else:
                raise StructureChangedError(
                    f"cannot write back `{format_path(self.paths[i])}`: it is an array stored "
                    f"directly on a module; wrap it in an nnx.Variable"
                )

    def index_map(self) -> graphlib.IndexMap:
        """Graph index -> the caller's node, to resolve outputs that reference inputs."""
        return graphlib.IndexMap({index: node for node, index in self._ref_index.items()})

    # -- inside a trace -----------------------------------------------------
    def rebuild(self, values: Sequence[Any]) -> tuple[Any, ...]:
        """Fresh nodes of the same structure holding ``values`` (tracers, inside a trace)."""
        return nnx.graph.unflatten(self.graphdef, list(values))

    def describe_change(
        self, before: tuple[Any, ...], after: tuple[Any, ...], names: Sequence[str]
    ) -> str:
        """What differs between two rebuilt node tuples, by path; ``names[k]`` names node k."""
        old, new = _path_fingerprints(before), _path_fingerprints(after)

        def show(path: tuple[Hashable, ...]) -> str:
            return format_path((names[path[0]], *path[1:]))

        lines = [f"added `{show(p)}`" for p in new.keys() - old.keys()]
        lines += [f"removed `{show(p)}`" for p in old.keys() - new.keys()]
        lines += [f"changed `{show(p)}`" for p in old.keys() & new.keys() if old[p] != new[p]]
        return "; ".join(sorted(lines)) or "the node types or Variable metadata changed"

    def _contents(self) -> tuple[list[Any], list[Any]]:
        """The keys, and the values, of the watched dicts and lists (lengths are checked apart)."""
        values = list(chain.from_iterable(map(dict.values, self._dicts)))
        values += chain.from_iterable(self._lists)
        return list(chain.from_iterable(self._dicts)), values


# Not looked into: functions and modules, and flax's immutable mappings (replaced, not mutated).
_OPAQUE = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    graphlib.HashableMapping,
)


def _mutable_containers(nodes: Any) -> tuple[list[dict], list[list], list[nnx.Variable]]:
    """Every dict, list and Variable whose contents fix the structure of ``nodes``.

    That is the attributes of every node, each Variable's metadata, and the
    insides of mutable static values (a config dataclass stored on a module):
    what a user can change between calls without replacing a watched object.
    """
    dicts: list[dict[Any, Any]] = []
    lists: list[list[Any]] = []
    variables: list[nnx.Variable] = []
    seen: set[int] = set()

    def watch(obj: Any) -> None:
        if id(obj) in seen or isinstance(obj, _ATOMS + _OPAQUE):
            return
        seen.add(id(obj))
        if isinstance(obj, nnx.Variable):
            variables.append(obj)  # its metadata is compared by value, see unchanged()
            return
        if hasattr(obj, "shape"):  # an array: its value is data, not structure
            return
        children: Iterable[Any]
        if type(obj) is dict:
            dicts.append(obj)
            children = obj.values()
        elif type(obj) is list:
            lists.append(obj)
            children = obj
        elif isinstance(obj, tuple):
            children = obj
        else:
            attributes = getattr(obj, "__dict__", None)
            if type(attributes) is not dict:
                return
            dicts.append(attributes)
            children = attributes.values()
        for child in children:
            watch(child)

    watch(nodes)
    return dicts, lists, variables


def _path_fingerprints(nodes: Any) -> dict[tuple[Hashable, ...], Any]:
    """Path -> what a structural comparison sees there (a type for nodes, a value for statics)."""
    out = {}
    for path, value in nnx.graph.iter_graph(nodes):
        if any(str(part).startswith("_pytree__") for part in path):
            continue  # flax's bookkeeping; the user-visible attribute shows the change
        if isinstance(value, nnx.Variable) or graphlib.is_node(value) or hasattr(value, "shape"):
            out[path] = type(value)
        else:
            out[path] = fingerprint(value)
    return out


class _Identity:
    """Compares by identity; keeps its object alive so the id is never reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_ATOMS = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis), type)


def fingerprint(x: Any) -> Hashable:
    """A hashable key equal for structurally equal objects, independent of identity.

    Functions compare by code and closed-over values, so ``optax.adam(1e-3)``
    made twice gives the same key; objects without a structural reading fall
    back to their own ``==`` if hashable, else to identity.

    Example::

        assert fingerprint(optax.adam(1e-3)) == fingerprint(optax.adam(1e-3))
        assert fingerprint(optax.adam(1e-3)) != fingerprint(optax.adam(1e-2))
    """
    return _fingerprint(x, set())


def _fingerprint(x: Any, active: set[int]) -> Hashable:
    if isinstance(x, _ATOMS):
        return (type(x), x)
    if id(x) in active:  # a cycle, e.g. a recursive closure
        return ("cycle", type(x))
    active.add(id(x))
    try:
        return _fingerprint_compound(x, active)
    finally:
        active.discard(id(x))


def _cell_fingerprint(cell: types.CellType, active: set[int]) -> Hashable:
    try:
        return _fingerprint(cell.cell_contents, active)
    except ValueError:  # a name the function uses but that is not assigned yet
        return ("empty cell",)


def _fingerprint_compound(x: Any, active: set[int]) -> Hashable:
    fp = functools.partial(_fingerprint, active=active)
    if isinstance(x, list | tuple):
        return (type(x), tuple(map(fp, x)))
    if isinstance(x, dict | graphlib.HashableMapping):
        return (type(x), tuple((fp(k), fp(v)) for k, v in x.items()))
    if isinstance(x, types.FunctionType):
        cells = tuple(_cell_fingerprint(c, active) for c in x.__closure__ or ())
        return (types.FunctionType, x.__code__, cells, fp(x.__defaults__), fp(x.__kwdefaults__))
    if isinstance(x, functools.partial):
        return (functools.partial, fp(x.func), fp(x.args), fp(x.keywords))
    if isinstance(x, types.MethodType):
        return (types.MethodType, fp(x.__func__), fp(x.__self__))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = tuple(fp(getattr(x, f.name)) for f in dataclasses.fields(x))
        return (type(x), fields)
    try:
        hash(x)
    except TypeError:
        return _Identity(x)
    return x
