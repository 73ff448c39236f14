"""Resolution: from spec prefixes to one validated `Sharding` per array.

Pure functions of (prefix, leaves, paths, mesh). `to_sharding` is the one
place where a spec becomes a `NamedSharding`; `broadcast_prefix` spreads a
spec tree (a pytree prefix of the arguments or the output, with
`StateSharding` plans at graph nodes) onto the leaves it covers.

Example:

```python
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import meshlift as ml
from meshlift.plans.resolve import to_sharding

mesh = ml.make_mesh({"data": 2, "model": 4})
sharding = to_sharding(P("data"), mesh, "batch", jnp.ones((8, 3)))
assert sharding.spec == P("data")
```
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from meshlift.errors import PlanError, duplicate_axis_error
from meshlift.graph.split import GraphSplit, is_graph_leaf, variable_paths
from meshlift.paths import Path, format_path, key_name, listing, user_stacklevel
from meshlift.plans.sharding import (
    Spec,
    StateSharding,
    as_plan,
    is_path_filter,
    is_spec,
    value_shape,
)
from meshlift.plans.specs import repeats_an_axis, spec_problems


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one spec places an array: the checks of a call, as data (`ml.explain` reads it).

    `spec` is the PartitionSpec (None: none, or another kind of Sharding,
    which JAX checks), `mesh_shape` the mesh it is on (a NamedSharding's own), and
    `problems` every reason it cannot place the array.
    """

    spec: PartitionSpec | None
    mesh_shape: dict[str, int]
    problems: tuple[str, ...]


def placement(
    spec: Spec,
    mesh_shape: Mapping[str, int],
    shape: tuple[int, ...] | None,
    what: str = "sharding",
) -> Placement:
    """`spec` placing an array of `shape` (None: not known yet) on a mesh of `mesh_shape`.

    Example:

    ```python
    from meshlift.plans.resolve import placement

    [problem] = placement(P("data"), {"data": 2}, (7,)).problems
    assert "dimension 0 (size 7) is not divisible by 2" in problem
    ```
    """
    if isinstance(spec, NamedSharding):
        mesh_shape, spec = dict(spec.mesh.shape), spec.spec
    if not isinstance(spec, PartitionSpec):
        return Placement(None, dict(mesh_shape), ())
    return Placement(spec, dict(mesh_shape), tuple(spec_problems(spec, shape, mesh_shape, what)))


def to_sharding(
    spec: Spec, mesh: Any, path: str, value: Any, what: str = "sharding"
) -> Sharding | None:
    """Resolve a leaf spec to a `Sharding` for `value` at `path`, validating it.

    Raises a PlanError naming the path, shape, spec and mesh, calling the spec
    by the transform's own argument name `what`. With `value`
    None (an output whose shape is not known yet) only the mesh axes are checked.
    """
    if spec is None:
        return None
    if isinstance(spec, PartitionSpec) and mesh is None:
        raise PlanError(
            f"`{path}` has the bare spec {spec} but no mesh is known: pass mesh= to the "
            f"transform, or call it inside `with ml.use_mesh(mesh):`"
        )
    held = _held_tree(value)
    if held is not None:  # a Variable holding a pytree: the spec is a prefix of its leaves
        for keys, leaf in jax.tree_util.tree_flatten_with_path(held)[0]:
            to_sharding(spec, mesh, ".".join([path, *map(key_name, keys)]), leaf, what)
        return NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec
    shape = value_shape(value) if value is not None else None
    placed = placement(spec, mesh_shape(mesh) or {}, shape, what)
    if placed.problems:
        message = (
            f"cannot shard `{path}` (shape {shape}) with {what} {placed.spec} on mesh "
            f"{placed.mesh_shape}: " + "; ".join(placed.problems)
        )
        if placed.spec is not None and repeats_an_axis(placed.spec):
            raise duplicate_axis_error()(message, mesh, placed.spec)
        raise PlanError(message)
    return NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec


def _held_tree(value: Any) -> Any:
    """The pytree a Variable holds (`nnx.Variable({"a": ...})`), or None for an array."""
    if not isinstance(value, nnx.Variable):
        return None
    held = value.get_raw_value()
    return None if jax.tree_util.treedef_is_leaf(jax.tree.structure(held)) else held


def mesh_shape(mesh: Any) -> dict[str, int] | None:
    return dict(mesh.shape) if mesh is not None else None


def broadcast_prefix(prefix: Any, tree: Any, what: str, noun: str, path: str = "") -> list[Any]:
    """One spec per leaf of `tree` (graph nodes are leaves) from a prefix of it.

    A plan stands for everything below where it is given: each leaf gets the
    plan's view `below` the leaf's keys from there, so a plan made from an
    object (`from_metadata`, `ml.get_sharding`) means the same wherever that
    object is passed. A Variable holding a spec (`ml.get_sharding`'s output)
    gives that spec.
    """
    if is_graph_leaf(tree) and isinstance(prefix, Mapping) and not is_graph_leaf(prefix):
        prefix = StateSharding.from_state(prefix)
    if isinstance(prefix, nnx.Variable) and is_spec(prefix.get_raw_value()):
        prefix = prefix.get_raw_value()
    if is_spec(prefix) or is_graph_leaf(tree):
        if not is_spec(prefix):
            raise PlanError(
                f"{what} at `{path or '<root>'}` is a {type(prefix).__name__} but the value "
                f"there is a {type(tree).__name__}; use a PartitionSpec or a StateSharding"
            )
        plan = as_plan(prefix)
        if isinstance(plan, StateSharding):
            return [plan.below(keys) for keys in _leaf_keys(tree)]
        return [plan] * len(jax.tree.leaves(tree, is_leaf=is_graph_leaf))
    if isinstance(prefix, tuple | list) and isinstance(tree, tuple | list):
        if len(prefix) == len(tree):
            return [
                spec
                for i, (p, t) in enumerate(zip(prefix, tree, strict=True))
                for spec in broadcast_prefix(p, t, what, noun, f"{path}[{i}]")
            ]
    elif isinstance(prefix, Mapping) and isinstance(tree, Mapping) and set(prefix) == set(tree):
        return [
            spec
            for k in sorted(tree)
            for spec in broadcast_prefix(prefix[k], tree[k], what, noun, f"{path}.{k}".lstrip("."))
        ]
    else:  # any other pytree node (a flax struct such as TrainState): match it one level down
        prefix_children, prefix_def = _one_level(prefix)
        tree_children, tree_def = _one_level(tree)
        is_node = not (len(prefix_children) == 1 and prefix_children[0][1] is prefix)
        if is_node and prefix_def == tree_def:
            return [
                spec
                for (key, p), (_, t) in zip(prefix_children, tree_children, strict=True)
                for spec in broadcast_prefix(p, t, what, noun, f"{path}.{key}".lstrip("."))
            ]
    raise PlanError(
        f"{what} does not match the {noun} at "
        f"`{path or '<root>'}`: the spec is {prefix!r} but the value is a "
        f"{type(tree).__name__}; a spec tree must be a prefix of it (one entry per tuple "
        f"element or dict key)"
    )


def _leaf_keys(tree: Any) -> list[Path]:
    """The keys of each leaf of `tree` (graph nodes are leaves) below its root, as a graph
    path has them: names, and list positions as numbers."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_graph_leaf)[0]
    return [tuple(map(_plain_key, keys)) for keys, _ in leaves]


def _plain_key(key: Any) -> Hashable:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def _one_level(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The (key, child) pairs of a pytree node, and its one-level treedef."""
    children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    return [(".".join(key_name(k) for k in keys), child) for keys, child in children], treedef


class PlanUse:
    """Which filters of each plan matched, over every argument it was given for in one call.

    A plan made from an object (its filters are that object's paths) none of
    whose filters matched anything there (but `...`) is an error: it was
    given for something else (a plan made from a `TrainState` given for its
    `params`, say), and running it would move the caller's arrays to the
    placement of `...`. Any other path filter that matched nothing is a
    warning (a typo?); a type, tag or predicate may match nothing in one call.
    """

    def __init__(self) -> None:
        self._plans: dict[int, tuple[StateSharding, set[int], list[str]]] = {}

    def rule(self, plan: StateSharding, path: Path, value: Any, full: str) -> int:
        """The index of `plan`'s rule for `value` at `path`, noted as used for `full`."""
        index = plan.rule_for(path, value)
        origin = plan.origin
        _, matched, seen = self._plans.setdefault(id(origin), (origin, set(), []))
        matched.add(index)
        seen.append(full)
        return index

    def check(self, what: str, mesh: Any = None) -> None:
        """Raise for a plan that matched nothing (naming the `mesh`); warn for each filter
        that matched nothing."""
        for plan, matched, seen in self._plans.values():
            filters = [(i, f, spec) for i, (f, _, spec) in enumerate(plan.rules) if f is not ...]
            if plan.names_paths and matched.isdisjoint(i for i, _, _ in filters):
                raise PlanError(
                    f"no filter of the plan in {what} matches anything it was given for (it "
                    f"saw {listing(seen)}; its filters are {[f for _, f, _ in filters]}), so "
                    f"every array there would take the spec of `...` and be moved to it on "
                    f"mesh {mesh_shape(mesh)}. "
                    f"Give the plan for the object it was made from (a plan from "
                    f"`StateSharding.from_metadata(state)` or `ml.get_sharding(state, mesh)` "
                    f"where `state` is passed), or match these paths"
                )
            for i, filter_, spec in filters:
                if i not in matched and is_path_filter(filter_):
                    warnings.warn(
                        f"the filter {filter_!r} (spec {spec}) of the plan in {what} matches "
                        f"none of {listing(seen)}, so it does nothing: check its path or tag, "
                        f"or drop it (an earlier filter may match first)",
                        UserWarning,
                        stacklevel=user_stacklevel(),
                    )


def variable_shardings(
    node_specs: Sequence[tuple[str, Any, Any]],
    leaf_position: Mapping[Any, int],
    count: int,
    mesh: Any,
    what: str,
    use: PlanUse,
) -> tuple[Sharding | None, ...]:
    """One sharding per leaf of a split, from each top-level node's spec.

    `node_specs` holds `(name, node, spec)` per top-level graph node;
    `leaf_position` maps `id(variable)` of each Variable, and the split path
    (`(k, *path)`, node `k`) of each array stored on a module, to its split
    position. A shared Variable reached by two paths must get one spec from both.
    """
    shardings: list[Sharding | None] = [None] * count
    origin: dict[int, tuple[str, Any]] = {}
    for k, (name, node, node_spec) in enumerate(node_specs):
        for path, variable in variable_paths(node):
            key = id(variable) if isinstance(variable, nnx.Variable) else (k, *path)
            if key not in leaf_position:
                continue  # an array on a shared module, met again by another path
            full = format_path((name, *path))
            if isinstance(node_spec, StateSharding):
                spec = node_spec.rules[use.rule(node_spec, path, variable, full)][2]
            else:
                spec = node_spec
            i = leaf_position[key]
            if i not in origin:
                origin[i] = (full, spec)
                shardings[i] = to_sharding(spec, mesh, full, variable, what)
            elif origin[i][1] != spec:
                raise PlanError(
                    f"the shared Variable at `{origin[i][0]}` and `{full}` (shape "
                    f"{value_shape(variable)}) is given two specs, {origin[i][1]} and {spec}, on "
                    f"mesh {mesh_shape(mesh)}; give both paths the same spec"
                )
    return tuple(shardings)


class ArgumentShardings(NamedTuple):
    """One call's input shardings: per Variable of its split (split order), per other leaf
    (by leaf position), and the positions of the other leaves a plan gave theirs (its
    filters may read the value)."""

    variables: tuple[Sharding | None, ...]
    leaves: dict[int, Sharding | None]
    by_plan: tuple[int, ...]


def argument_shardings(
    positional: Any,
    args: tuple[Any, ...],
    leaves: Sequence[Any],
    leaf_paths: Sequence[Path],
    node_pos: Sequence[int],
    dyn_pos: Sequence[int],
    split: GraphSplit,
    mesh: Any,
    what: str,
) -> ArgumentShardings:
    """The shardings of a call's arguments from `positional`, a spec prefix of `args`.

    `leaves` are the flat arguments (`leaf_paths` their paths), the graph nodes at
    `node_pos` (taken apart in `split`), the other leaves at `dyn_pos`. Every plan's
    use is checked once, over the whole call (`PlanUse`).
    """
    prefix = broadcast_prefix(positional, args, what, "arguments")
    prefix += [None] * (len(leaves) - len(prefix))  # keyword arguments: given no specs
    position: dict[Any, int] = {  # a Variable by identity; an array by where it is stored
        id(v) if isinstance(v, nnx.Variable) else p: i
        for i, (p, v) in enumerate(zip(split.paths, split.leaves, strict=True))
    }
    node_specs = [(format_path(leaf_paths[pos]), leaves[pos], prefix[pos]) for pos in node_pos]
    use = PlanUse()
    variables = variable_shardings(node_specs, position, len(split.leaves), mesh, what, use)
    others = {
        pos: leaf_sharding(prefix[pos], leaf_paths[pos], leaves[pos], mesh, what, use)
        for pos in dyn_pos
    }
    use.check(what, mesh)
    by_plan = tuple(pos for pos in dyn_pos if isinstance(prefix[pos], StateSharding))
    return ArgumentShardings(variables, others, by_plan)


def leaf_sharding(
    spec: Any, path: Path, value: Any, mesh: Any, what: str, use: PlanUse | None = None
) -> Sharding | None:
    """The sharding of one non-graph leaf at `path` (a plan is asked from where it was
    given: its view's root), its use noted in `use`."""
    if isinstance(spec, StateSharding):
        rule = (
            spec.rule_for((), value)
            if use is None
            else use.rule(spec, (), value, format_path(path))
        )
        spec = spec.rules[rule][2]
    return to_sharding(spec, mesh, format_path(path), value, what)


def output_shardings(out_specs: Any, abstract_out: Any, nodes: Any, mesh: Any, what: str) -> Any:
    """Shardings for an encoded output, a plan resolved per Variable of output modules.

    `abstract_out` is the decoded abstract output; `nodes` the
    `graph.OutputNodes` that say where its graph nodes are.
    """
    prefix = broadcast_prefix(out_specs, abstract_out, what, "output")
    leaves = nodes.treedef.flatten_up_to(abstract_out)
    keypaths = [
        k for k, _ in jax.tree_util.tree_flatten_with_path(abstract_out, is_leaf=is_graph_leaf)[0]
    ]
    result: list[Any] = []  # a sharding per leaf, a tuple of them per output graph node
    for i, (spec, leaf) in enumerate(zip(prefix, leaves, strict=True)):
        if i not in nodes.graphdefs:
            path = ("output", *map(key_name, keypaths[i]))
            result.append(leaf_sharding(spec, path, leaf, mesh, what))
            continue
        variables = dict(variable_paths(leaf))
        result.append(
            tuple(
                leaf_sharding(
                    spec.below(path) if isinstance(spec, StateSharding) else spec,
                    ("output", *path),
                    variables[path],
                    mesh,
                    what,
                )
                for path in nodes.paths[i]
            )
        )
    return nodes.treedef.unflatten(result)


def spec_leaves(specs: Any) -> list[Any]:
    """The leaves of a spec tree, plans and mappings of specs kept whole."""
    return jax.tree.leaves(specs, is_leaf=lambda x: is_spec(x) or isinstance(x, Mapping))


def refuse_graph_nodes(spec_trees: Iterable[tuple[str, Any]]) -> None:
    """Raise a PlanError naming the first `(what, tree)` with a graph node where specs go."""
    for what, tree in spec_trees:
        node = next((s for s in spec_leaves(tree) if is_graph_leaf(s)), None)
        if node is not None:
            raise PlanError(
                f"{what} contains a {type(node).__name__}, a graph node, where specs go; give "
                f"a StateSharding (or an nnx.State / nested dict of PartitionSpecs) instead"
            )


def simple_shardings(specs: Any, mesh: Any, what: str) -> Any:
    """A spec tree without plans, each leaf resolved with only its mesh axes checked."""
    return jax.tree.map(
        lambda s: to_sharding(s, mesh, "output", None, what), specs, is_leaf=is_spec
    )
