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
from meshlift.resolve import to_sharding

mesh = ml.make_mesh({"data": 2, "model": 4})
sharding = to_sharding(P("data"), mesh, "batch", jnp.ones((8, 3)))
assert sharding.spec == P("data")
```
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from meshlift import compat
from meshlift.graph import is_graph_leaf, variable_paths
from meshlift.paths import Path, PlanError, format_path, key_name
from meshlift.sharding import Spec, StateSharding, as_plan, is_spec, value_shape
from meshlift.specs import repeats_an_axis, spec_problems


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
    from meshlift.resolve import placement

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


@functools.cache
def duplicate_axis_error() -> type[PlanError]:
    """The PlanError for a spec naming a mesh axis twice: also jax's `DuplicateSpecError`,
    so an `except` written for `jax.jit` catches it."""

    class DuplicateAxisError(PlanError, compat.duplicate_spec_error()):  # type: ignore[misc]
        __doc__ = duplicate_axis_error.__doc__
        __module__ = PlanError.__module__
        __qualname__ = "DuplicateAxisError"

        def __init__(self, message: str, mesh: Any = None, pspec: Any = None):
            PlanError.__init__(self, message)
            self.message, self.mesh, self.pspec = message, mesh, pspec  # jax's fields

        def __str__(self) -> str:
            return self.message

    return DuplicateAxisError


def _held_tree(value: Any) -> Any:
    """The pytree a Variable holds (`nnx.Variable({"a": ...})`), or None for an array."""
    if not isinstance(value, nnx.Variable):
        return None
    held = value.get_raw_value()
    return None if jax.tree_util.treedef_is_leaf(jax.tree.structure(held)) else held


def mesh_shape(mesh: Any) -> dict[str, int] | None:
    return dict(mesh.shape) if mesh is not None else None


def broadcast_prefix(prefix: Any, tree: Any, what: str, noun: str, path: str = "") -> list[Any]:
    """One spec per leaf of `tree` (graph nodes are leaves) from a prefix of it."""
    if is_graph_leaf(tree) and isinstance(prefix, Mapping) and not is_graph_leaf(prefix):
        prefix = StateSharding.from_state(prefix)
    if is_spec(prefix) or is_graph_leaf(tree):
        if not is_spec(prefix):
            raise PlanError(
                f"{what} at `{path or '<root>'}` is a {type(prefix).__name__} but the value "
                f"there is a {type(tree).__name__}; use a PartitionSpec or a StateSharding"
            )
        return [as_plan(prefix)] * len(jax.tree.leaves(tree, is_leaf=is_graph_leaf))
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


def _one_level(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The (key, child) pairs of a pytree node, and its one-level treedef."""
    children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    return [(".".join(key_name(k) for k in keys), child) for keys, child in children], treedef


def variable_shardings(
    node_specs: Sequence[tuple[str, Any, Any]],
    leaf_position: Mapping[Any, int],
    count: int,
    mesh: Any,
    what: str,
) -> tuple[Sharding | None, ...]:
    """One sharding per leaf of a split, from each top-level node's spec.

    `node_specs` holds `(name, node, spec)` per top-level graph node;
    `leaf_position` maps `id(variable)` of each Variable, and the split path
    (`(k, *path)`, node `k`) of each array stored on a module, to its split
    position. A shared Variable reached by two paths must get one spec from both.
    """
    shardings: list[Sharding | None] = [None] * count
    origin: dict[int, tuple[str, Any]] = {}
    matched: dict[int, set[int]] = {}  # id(plan) -> indices of rules that matched a Variable
    for k, (name, node, node_spec) in enumerate(node_specs):
        for path, variable in variable_paths(node):
            key = id(variable) if isinstance(variable, nnx.Variable) else (k, *path)
            if key not in leaf_position:
                continue  # an array on a shared module, met again by another path
            full = format_path((name, *path))
            if isinstance(node_spec, StateSharding):
                rule = node_spec.rule_for(path, variable)
                matched.setdefault(id(node_spec), set()).add(rule)
                spec = node_spec.rules[rule][2]
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
    _warn_unmatched(node_specs, matched, what)
    return tuple(shardings)


def _warn_unmatched(
    node_specs: Sequence[tuple[str, Any, Any]], matched: Mapping[int, set[int]], what: str
) -> None:
    """Warn about each filter of a plan that matched no Variable of the nodes it was given for."""
    plans = {id(spec): spec for _, _, spec in node_specs if isinstance(spec, StateSharding)}
    for key, plan in plans.items():
        names = ", ".join(f"`{name}`" for name, _, spec in node_specs if spec is plan)
        for i, (filter_, _, spec) in enumerate(plan.rules):
            if i not in matched.get(key, ()) and filter_ is not Ellipsis:
                warnings.warn(
                    f"the filter {filter_!r} (spec {spec}) of the plan in {what} matches no "
                    f"Variable of {names}, so it does nothing: check its path or tag, or drop "
                    f"it (an earlier filter may match first)",
                    UserWarning,
                    stacklevel=2,
                )


def leaf_sharding(spec: Any, path: Path, value: Any, mesh: Any, what: str) -> Sharding | None:
    """The sharding of one non-graph leaf at `path` (a plan is asked by the path)."""
    if isinstance(spec, StateSharding):
        spec = spec.spec_for(path, value)
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
                leaf_sharding(spec, ("output", *path), variables[path], mesh, what)
                for path in nodes.paths[i]
            )
        )
    return nodes.treedef.unflatten(result)


def spec_leaves(specs: Any) -> list[Any]:
    """The leaves of a spec tree, plans and mappings of specs kept whole."""
    return jax.tree.leaves(specs, is_leaf=lambda x: is_spec(x) or isinstance(x, Mapping))


def simple_shardings(specs: Any, mesh: Any, what: str) -> Any:
    """A spec tree without plans, each leaf resolved with only its mesh axes checked."""
    return jax.tree.map(
        lambda s: to_sharding(s, mesh, "output", None, what), specs, is_leaf=is_spec
    )
