"""Split and merge: the NNX graph nodes of a call's arguments <-> a flat tuple of arrays.

`GraphSplit` flattens the caller's graph nodes once and keeps that view
while their structure is unchanged; per call it gathers the arrays out of
the Variables and scatters new ones back. Inside the traced function,
`Rebuilt` makes fresh nodes around the tracers and, after the user's
function ran, `Rebuilt.changes` says what happened to them: new values
only, or a new graph (a swap, a replaced submodule, a new attribute) that
`apply_graph_update` carries back the way `nnx.jit`'s graph mode does:
the caller's nodes re-pointed, no value copied into an object that was
replaced. Graph nodes in outputs go through `encode_outputs` and
`decode_outputs`.

Example:

```python
from flax import nnx
from meshlift.graph.split import GraphSplit

model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
split = GraphSplit((model,))
arrays = split.gather()               # one array per Variable, shared ones once
assert split.unchanged()              # cheap: identity checks only
split.scatter(range(len(arrays)), arrays, (model,))
```
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib

from meshlift import compat, modes, speedups
from meshlift.errors import PlanError, StructureChangedError
from meshlift.graph.structure import _ATOMS, Watcher, fingerprint, per_type
from meshlift.paths import Path, format_path, listing


def is_graph_leaf(x: Any) -> bool:
    """True for what split/merge handles: NNX graph nodes (modules, optimizers, Rngs) and Variables."""
    return is_graph_type(type(x))


@per_type
def is_graph_type(cls: type) -> bool:
    """`is_graph_leaf` by type."""
    # Cached per type: isinstance through flax's metaclass is slow on the per-call path.
    # Node types register when their class is created, before any instance reaches here.
    # A hijax Variable is no nnx.Variable: it is taken in to be refused by name (GraphSplit).
    hijax = getattr(nnx.variablelib, "HijaxVariable", None)
    return (
        issubclass(cls, nnx.Variable)
        or cls in graphlib.GRAPH_REGISTRY
        or (hijax is not None and issubclass(cls, hijax))
    )


def flatten(node: Any, **kwargs: Any) -> tuple[Any, Any]:
    """flax's graph-mode flatten, whatever the user's global graph/tree mode."""
    return nnx.graph.flatten(node, graph=True, **kwargs)


def variable_paths(node: Any) -> list[tuple[Path, Any]]:
    """(path, Variable) for every path of `node`: a shared Variable or module once per path.

    Example:

    ```python
    from meshlift.graph.split import variable_paths

    model = nnx.Module()
    model.embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    model.head = model.embed                   # tied
    paths = [p for p, _ in variable_paths(model)]
    assert paths == [("embed", "embedding"), ("head", "embedding")]
    ```
    """
    _, flat = flatten(node)
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


def raw(leaf: Any) -> Any:
    """A flat leaf's array: a Variable's stored value, or the leaf itself."""
    return leaf.get_raw_value() if isinstance(leaf, nnx.Variable) else leaf


class GraphSplit:
    """The flat view of a tuple of the caller's graph nodes: their leaves in a fixed order.

    Leaves are Variables (shared ones once) and arrays stored directly on a
    module (`nnx.data`). `names[k]`, if given, is the caller's name of node
    `k`, for errors. `key` is a fingerprint of the structure (types,
    static attributes by content, Variable metadata), never of identities, so
    two models of the same structure share compiled code. A split holds no
    reference to the caller's top-level nodes: it never keeps a dropped model alive.
    """

    def __init__(self, nodes: tuple[Any, ...], names: Sequence[str] | None = None):
        ref_index = graphlib.RefMap()
        self.graphdef, flat = flatten(nodes, ref_index=ref_index)
        self.paths: tuple[Path, ...] = tuple(flat.paths)
        self.leaves: tuple[Any, ...] = tuple(flat.leaves)
        _refuse_hijax(self.paths, self.leaves, names)
        self.key = fingerprint(self.graphdef)
        # graph index of each leaf's Variable (None for an array stored on a module)
        self.leaf_index = tuple(
            ref_index[leaf] if isinstance(leaf, nnx.Variable) else None for leaf in self.leaves
        )
        self._top_index = tuple(ref_index.get(node) for node in nodes)
        top = {id(node) for node in nodes}
        self._inner = {i: node for node, i in ref_index.items() if id(node) not in top}
        self._watcher = Watcher(nodes)
        self.unchanged = self._watcher.unchanged
        if modes.check_fast_paths:
            self._nodes = tuple(map(_weak_or_strong, nodes))
            self.unchanged = self._checked_unchanged
        # where each array stored on a module lives: (top-level position or None, the
        # inner parent node or None, attribute key)
        self._homes = {
            i: _home(nodes, path)
            for i, (path, leaf) in enumerate(zip(self.paths, self.leaves, strict=True))
            if not isinstance(leaf, nnx.Variable)
        }
        slots = compat.variable_slots()
        all_variables = all(isinstance(v, nnx.Variable) for v in self.leaves)
        self.fast = (
            slots is not None and all_variables and not any(v.hijax or v.ref for v in self.leaves)
        )
        self._slot = slots.value if slots is not None and self.fast else None
        self._last_positions: Sequence[int] | None = None
        self._last_targets: tuple[Any, ...] = ()

    # -- per call ---------------------------------------------------------
    # unchanged() -> bool: True if no attribute of any node was added, removed or replaced
    # since the split (the Watcher's check, set in __init__).

    def _checked_unchanged(self) -> bool:
        """The Watcher's verdict, verified by splitting again (`modes.check_fast_paths`)."""
        if not self._watcher.unchanged():
            return False
        nodes = tuple(ref() for ref in self._nodes)
        graphdef, flat = flatten(nodes, ref_index=graphlib.RefMap())
        same_leaves = len(flat.leaves) == len(self.leaves) and all(
            map(operator.is_, flat.leaves, self.leaves)
        )
        if not same_leaves or fingerprint(graphdef) != self.key:
            raise AssertionError(
                "meshlift's structure check found nothing changed, but splitting again "
                f"gives {'other leaves' if not same_leaves else 'another structure'}: the "
                "Watcher misses a kind of change"
            )
        return True

    def gather(self) -> tuple[Any, ...]:
        """The current array of every leaf, in split order."""
        if self._slot is None:
            return tuple(map(raw, self.leaves))
        return speedups.read_each(self._slot, self.leaves)

    def scatter(
        self, positions: Sequence[int], values: Sequence[Any], nodes: tuple[Any, ...]
    ) -> None:
        """Write each value at its split position (validated by the caller).

        A Variable takes the value; an array stored on a module (`nnx.data`) is
        replaced on its parent, found from `nodes` (this call's top-level nodes).
        """
        homes = self._homes
        if not homes or homes.keys().isdisjoint(positions):  # Variables only: one loop
            if self._slot is None:
                collections.deque(map(_set_raw_value, self._targets(positions), values), maxlen=0)
            else:
                speedups.write_each(self._slot, self._targets(positions), tuple(values))
            return
        moved = []
        for i, value in zip(positions, values, strict=True):
            if i in homes:
                top, parent, key = homes[i]
                parent = nodes[top] if parent is None else parent
                _node_impl(parent).set_key(parent, key, value)
                moved.append((i, value))
            else:
                _set_raw_value(self.leaves[i], value)
        if moved:  # the split now sees the new arrays, and so does the watcher
            new_leaves = list(self.leaves)
            for i, value in moved:
                new_leaves[i] = value
            self.leaves = tuple(new_leaves)
            self._last_positions = None
            self._watcher.snapshot()

    def slot_access(self, positions: tuple[int, ...]) -> tuple[Any, tuple, tuple] | None:
        """`(slot, leaves, targets)` where `gather` reads `slot` of each leaf and writing
        `positions` sets it on each of `targets`: None if some leaf needs flax's API (or
        is an array stored on a module)."""
        if self._slot is None:
            return None
        return self._slot, self.leaves, self._targets(positions)

    def _targets(self, positions: Sequence[int]) -> tuple[Any, ...]:
        """The leaves at `positions`; kept for the next call, which passes the same positions."""
        if positions is not self._last_positions:
            self._last_targets = tuple(map(self.leaves.__getitem__, positions))
            self._last_positions = positions
        return self._last_targets

    def index_map(self, nodes: tuple[Any, ...]) -> graphlib.IndexMap:
        """Graph index -> the caller's node (`nodes` are this call's top-level nodes)."""
        index_map = graphlib.IndexMap(self._inner)
        index_map.update(
            (i, n) for i, n in zip(self._top_index, nodes, strict=True) if i is not None
        )
        return index_map


def _refuse_hijax(paths: Sequence[Path], leaves: Sequence[Any], names: Any) -> None:
    """Refuse hijax Variables (`hijax=True`), naming them: they are no `nnx.Variable`s, and
    flax's own `nnx.jit` cannot update them in a trace either."""
    hijax_type = getattr(nnx.variablelib, "HijaxVariable", None)
    if hijax_type is None:
        return
    found = [path for path, leaf in zip(paths, leaves, strict=True) if isinstance(leaf, hijax_type)]
    if found:
        shown = [format_path((names[path[0]], *path[1:]) if names else path) for path in found]
        raise PlanError(
            f"{listing(shown)} {'is a hijax Variable' if len(found) == 1 else 'are hijax Variables'}"
            f" (`hijax=True`), which meshlift cannot lift yet (flax's `nnx.jit` cannot update "
            f"them in a trace either): make "
            f"{'it a plain Variable' if len(found) == 1 else 'them plain Variables'}"
            f", or `ref=True` for a mutable array that is updated in place"
        )


def _weak_or_strong(node: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(node)
    except TypeError:
        return lambda: node


def _set_raw_value(variable: Any, value: Any) -> None:
    variable.set_raw_value(value)


def _home(nodes: tuple[Any, ...], path: Path) -> tuple[Any, Any, Any]:
    """Where the array at `path` is stored: a top-level node's position, or its parent."""
    if len(path) == 2:
        return path[0], None, path[1]
    parent = nodes[path[0]]  # type: ignore[call-overload]  # a split path starts with a position
    for key in path[1:-1]:
        parent = _node_impl(parent).node_dict(parent)[key]
    return None, parent, path[-1]


def _node_impl(node: Any) -> Any:
    """flax's implementation of a graph node type (the node is known to be one)."""
    return graphlib.get_node_impl(node)


# -- inside a trace ----------------------------------------------------------------------


class Rebuilt:
    """Fresh nodes of a split's structure around `values` (tracers), and what became of them."""

    def __init__(self, graphdef: Any, values: Sequence[Any]):
        index_ref = graphlib.IndexMap()
        self.nodes = nnx.graph.unflatten(graphdef, list(values), index_ref=index_ref)
        self.values = tuple(values)
        self._outer_index = graphlib.RefMap((node, i) for i, node in index_ref.items())
        self.detached: dict[int, Any] = {}  # see `_detached`, found by `changes`

    def changes(
        self, unchanged_graphdef: Any, leaf_position: dict[int, int], arrays: Sequence[int]
    ) -> tuple[graphlib.RefMap, list[Any], GraphUpdate | None]:
        """The nodes' index, their leaves now, and a `GraphUpdate` if more than values changed.

        `unchanged_graphdef` is the split's graphdef with outer indices equal to
        its own: equal to the new one exactly when only values changed.
        `leaf_position` maps a caller Variable's graph index to its split position;
        `arrays` are the split positions of arrays stored directly on modules, which
        only a graph update can write back.
        """
        ref_index = graphlib.RefMap()
        graphdef, flat = flatten(self.nodes, ref_index=ref_index, ref_outer_index=self._outer_index)
        leaves = [raw(leaf) for leaf in flat.leaves]
        try:
            same = graphdef == unchanged_graphdef and same_static_objects(
                graphdef, unchanged_graphdef
            )
        except Exception:  # a static value that compares elementwise
            same = False
        if same and all(leaves[i] is self.values[i] for i in arrays):
            return ref_index, self._in_place(leaves, range(len(leaves))), None
        sources, indices = [], []
        for leaf in flat.leaves:
            is_variable = isinstance(leaf, nnx.Variable)
            outer = self._outer_index.get(leaf) if is_variable else None
            sources.append(leaf_position.get(outer) if outer is not None else None)
            indices.append(ref_index[leaf] if is_variable else None)
        leaves = self._in_place(leaves, sources)
        in_place = frozenset(  # a ref=True Variable's reference, mutated through: kept
            s
            for value, s in zip(leaves, sources, strict=True)
            if s is not None and value is self.values[s] and compat.is_ref(value)
        )
        self.detached = self._detached(ref_index, leaf_position)
        given = set(map(id, static_objects(unchanged_graphdef)))
        made = [v for v in static_objects(graphdef) if id(v) not in given and _mutable(v)]
        update = GraphUpdate(
            graphdef,
            tuple(flat.paths),
            tuple(sources),
            tuple(indices),
            in_place,
            self.detached,
            tuple(made),
        )
        return ref_index, leaves, update

    def _detached(
        self, reachable: graphlib.RefMap, leaf_position: dict[int, int]
    ) -> dict[int, Any]:
        """Split position -> new value, for each of the caller's Variables that the function
        gave a new value and then left unreachable from the arguments (a submodule holding
        it was replaced): run eagerly, the caller's Variable holds that value."""
        detached: dict[int, Any] = {}
        for node, outer in self._outer_index.items():
            position = leaf_position.get(outer)
            if position is None or not isinstance(node, nnx.Variable) or node in reachable:
                continue
            value = raw(node)
            if value is not self.values[position]:
                detached[position] = value
        return detached

    def _in_place(self, leaves: list[Any], sources: Iterable[int | None]) -> list[Any]:
        """`leaves` with flax's "updated in place" marker (a `ref=True` Variable's array
        reference, mutated through) replaced by the input it stands for: nothing to write."""
        if _NO_UPDATE is None or not any(type(v) is _NO_UPDATE for v in leaves):
            return leaves
        return [
            self.values[source] if type(v) is _NO_UPDATE and source is not None else v
            for v, source in zip(leaves, sources, strict=True)
        ]


_NO_UPDATE: Any = getattr(graphlib, "NoUpdate", None)


class GraphUpdate:
    """A new graph for the caller's nodes, found while tracing; applied after the call.

    `sources[j]` is the split position of the caller's Variable that new leaf
    `j` is (it keeps that Variable's sharding), or None for a new one. `in_place`
    are the split positions whose value is the caller's own reference (a
    `ref=True` Variable's, mutated through it): not an output, kept as it is.
    `detached` are the split positions of Variables given a new value and then
    left out of the new graph: their new values are written to the caller's
    Variables, which are not re-pointed anywhere. `made` are the mutable static
    objects the function made and stored (a new list, say): a call that replayed the
    update without running the Python again would hand the caller those very objects
    again, changed in place since maybe, where eager execution makes new ones.
    """

    def __init__(
        self,
        graphdef: Any,
        paths: tuple[Path, ...],
        sources: tuple[int | None, ...],
        indices: tuple[int | None, ...],
        in_place: frozenset[int] = frozenset(),
        detached: Iterable[int] = (),
        made: tuple[Any, ...] = (),
    ):
        self.graphdef, self.paths, self.sources, self.indices = graphdef, paths, sources, indices
        self.in_place, self.detached, self.made = in_place, tuple(detached), made

    def check_metadata(self, before: Any, names: Sequence[str]) -> None:
        """Refuse if the function changed the metadata of a caller's Variable (not carried back).

        `before` is the split's graphdef; `names[k]` names top-level node `k`.
        """
        old = {
            nodedef.index: nodedef.metadata
            for nodedef in before.nodes
            if isinstance(nodedef, graphlib.VariableDef)
        }
        new = [n for n in self.graphdef.nodes if isinstance(n, graphlib.VariableDef)]
        changed = {
            n.index for n in new if n.outer_index in old and n.metadata != old[n.outer_index]
        }
        if changed:
            index_of = dict(zip(self.paths, self.indices, strict=True))
            paths = [
                format_path((names[p[0]], *p[1:]))  # type: ignore[call-overload]
                for p, i in index_of.items()
                if i in changed
            ]
            raise StructureChangedError(
                f"the lifted function changed the metadata of {listing(paths)}; meshlift carries "
                f"back new values and re-pointed attributes, not Variable metadata. Change "
                f"metadata outside the lifted function."
            )

    def leaves(self, var_out: Sequence[Any], extra: Sequence[Any]) -> list[Any]:
        """The new graph's leaves out of the staged output: the caller's Variables' new
        values (by split position; flax's "no update" where kept in place) and, in order,
        those of Variables made inside."""
        extras = iter(extra)
        return [
            next(extras) if s is None else _NO_UPDATE() if s in self.in_place else var_out[s]
            for s in self.sources
        ]

    def apply(
        self, values: Sequence[Any], index_map: graphlib.IndexMap, statics: StaticObjects = None
    ) -> graphlib.IndexMap:
        """Re-point the caller's nodes as the function did, with the caller's `statics`;
        returns new index -> object."""
        index_ref = graphlib.IndexMap()
        nnx.graph.unflatten(
            with_statics(self.graphdef, statics),
            list(values),
            index_ref=index_ref,
            outer_index_outer_ref=index_map,
        )
        return index_ref


# -- static objects ------------------------------------------------------------------------

# A traced object -> the caller's object at its place (by id), or None where they are one.
StaticObjects = dict[int, Any] | None


def static_objects(graphdef: Any) -> list[Any]:
    """The static attribute values of `graphdef`, in its order: the objects themselves."""
    return [attr.value for _, attr in graphdef.attributes if isinstance(attr, graphlib.Static)]


def same_static_objects(new: Any, old: Any) -> bool:
    """Whether two equal graphdefs hold the same static objects wherever identity matters:
    `m.b = m.a` re-points `m.b`, a change even where the two values compare equal."""
    pairs = zip(static_objects(new), static_objects(old), strict=True)
    return all(a is b or not _mutable(a) for a, b in pairs)


def _mutable(value: Any) -> bool:
    """Whether `value` is or holds an object that may change in place (its identity matters)."""
    if type(value) in (tuple, frozenset):
        return any(map(_mutable, value))
    return not isinstance(value, _ATOMS)


def caller_statics(traced: Any, now: Any) -> StaticObjects:
    """Where the graphdef a function was traced from (`traced`) and the caller's split
    (`now`, equal to it) hold different static objects: the staged function is shared by
    callers of one structure, and what tracing found must be given the caller's own.

    Example:

    ```python
    from meshlift.graph.split import GraphSplit, caller_statics

    first, second = nnx.Module(), nnx.Module()
    first.config, second.config = [1], [1]   # equal, not one object
    traced, now = GraphSplit((first,)).graphdef, GraphSplit((second,)).graphdef
    assert caller_statics(traced, now)[id(first.config)] is second.config
    assert caller_statics(traced, traced) is None
    ```
    """
    if traced is now:
        return None
    pairs = zip(static_objects(traced), static_objects(now), strict=True)
    return {id(a): b for a, b in pairs if a is not b} or None


def with_statics(graphdef: Any, statics: StaticObjects) -> Any:
    """`graphdef` with each static object in `statics` replaced by the caller's."""
    if not statics:
        return graphdef
    attributes = [
        (key, graphlib.Static(statics[id(attr.value)]))
        if isinstance(attr, graphlib.Static) and id(attr.value) in statics
        else (key, attr)
        for key, attr in graphdef.attributes
    ]
    return dataclasses.replace(graphdef, attributes=attributes)


# -- graph nodes in outputs ---------------------------------------------------------------


class OutputNodes:
    """Where graph nodes sit in an output, and their graphdefs (static, found while tracing)."""

    def __init__(self, treedef: Any, graphdefs: dict[int, Any], paths: dict[int, tuple]):
        self.treedef = treedef
        self.graphdefs = graphdefs  # output leaf position -> graphdef of a graph node
        self.paths = paths  # output leaf position -> paths of that node's leaves


def encode_outputs(out: Any, ref_index: graphlib.RefMap) -> tuple[Any, OutputNodes]:
    """Replace graph nodes in the output by the tuple of their arrays.

    `ref_index` holds the arguments' nodes after the call, so an output node
    that is (or holds) an argument becomes a reference to it.
    """
    leaves, treedef = jax.tree.flatten(out, is_leaf=is_graph_leaf)
    graphdefs, paths = {}, {}
    for i, leaf in enumerate(leaves):
        if is_graph_leaf(leaf):
            graphdefs[i], flat = flatten(leaf, ref_index=ref_index)
            paths[i] = tuple(flat.paths)
            leaves[i] = tuple(map(raw, flat.leaves))
    nodes = OutputNodes(treedef, graphdefs, paths)
    return (jax.tree.unflatten(treedef, leaves) if graphdefs else out), nodes


def decode_outputs(
    user_out: Any, nodes: OutputNodes, index_map: graphlib.IndexMap, statics: StaticObjects = None
) -> Any:
    """Rebuild graph nodes in the output, with the caller's `statics`; references to
    arguments resolve through `index_map`.

    `index_map` is the caller's fresh map: the nodes rebuilt here are added to it.
    """
    if not nodes.graphdefs:
        return user_out
    items = nodes.treedef.flatten_up_to(user_out)
    for i, graphdef in nodes.graphdefs.items():
        unflattened = with_statics(graphdef, statics)
        items[i] = nnx.graph.unflatten(unflattened, list(items[i]), index_ref=index_map)
    return nodes.treedef.unflatten(items)


def abstract_index_map(graphdef: Any, values: Sequence[Any]) -> graphlib.IndexMap:
    """An index map over abstract copies of a split's nodes (for `eval_shape`)."""
    index_ref = graphlib.IndexMap()
    nnx.graph.unflatten(graphdef, list(values), index_ref=index_ref)
    return index_ref
