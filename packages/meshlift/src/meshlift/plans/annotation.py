"""One parameter's sharding annotation, and what its names mean to the library that wrote them.

`annotated_leaves(tree)` lists every array of a module, `nnx.State`, linen
variable dict or `jax.eval_shape` output with its path and its annotation
(`Annotated`): NNX `out_sharding` metadata, linen's `nn.Partitioned` and
`nn.LogicallyPartitioned` boxes. `Annotated.resolve` gives its mesh spec under
rules, as flax NNX (`out_sharding`) or linen (`LogicallyPartitioned`) means
the names, and the rules a mesh made it skip. Every reader of a plan from
annotations (`StateSharding.from_metadata`, `ml.get_sharding`, `ml.explain`,
`ml.eval_shape`) goes through here.

Example:

```python
import meshlift as ml
from flax import nnx
from jax.sharding import PartitionSpec as P
from meshlift.plans.annotation import annotated_leaves

init = ml.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
layer = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
kernel = {item.path: item for item in annotated_leaves(layer)}[("kernel",)]
assert kernel.resolve([("hidden", "model")])[0] == P("embed", "model")  # `embed`: a mesh axis
```
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from flax.core import meta as flax_meta
from flax.nnx import graphlib
from jax.sharding import NamedSharding, PartitionSpec

from meshlift.errors import PlanError
from meshlift.graph.split import variable_paths
from meshlift.paths import format_path, key_name
from meshlift.plans.logical import (
    UNASSIGNED,
    MeshAxes,
    SkippedRule,
    assign,
    check_rules,
    current_rules,
)
from meshlift.plans.specs import did_you_mean

Path = tuple[Hashable, ...]


@dataclasses.dataclass(frozen=True)
class Annotated:
    """One array of a tree: its path, its value (array or ShapeDtypeStruct) and its annotation.

    `holder` is the NNX Variable or flax box around the value (what NNX filters
    see), else the value itself. `names` is None for an unannotated array.
    `kind` says what the names mean, as the library that made them means it:

    - `"mesh"`: mesh axes (linen's `nn.Partitioned`, a NamedSharding);
    - `"nnx"`: a name the rules name is logical, any other a mesh axis (flax
      NNX's `out_sharding`);
    - `"logical"`: logical, a name no rule maps replicated (linen's
      `nn.LogicallyPartitioned`, `ml.with_logical_partitioning`).
    """

    path: Path
    value: Any
    holder: Any
    names: tuple[Any, ...] | None = None
    kind: str = "mesh"
    rules: tuple[tuple[str, Any], ...] | None = None
    mesh: Any = None
    within: Path = ()  # where the array sits in a Variable that holds a pytree

    @property
    def array_path(self) -> Path:
        """The array's path: the Variable's, and for a Variable holding a pytree, beyond."""
        return (*self.path, *self.within)

    @classmethod
    def of(cls, box: Any) -> Annotated:
        """The annotation of one Variable, flax box or array, without a path."""
        return cls((), box_value(box), box, **box_annotation(box))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.value, "shape", ()))

    def resolve(
        self, rules: Any = None, mesh: Any = None, *, require_rules: bool = True
    ) -> tuple[PartitionSpec, list[SkippedRule]]:
        """The mesh spec, and the rules skipped because `mesh` lacks their axes.

        `rules` replace those in context (the parameter's own rules apply first
        either way). Logical names need rules: without any, a PlanError (or,
        without `require_rules`, the names themselves, as flax's `get_partition_spec`).
        """
        decision = self.decide(rules, mesh, require_rules=require_rules)
        return decision.spec, decision.skipped

    def decide(
        self, rules: Any = None, mesh: Any = None, *, require_rules: bool = True
    ) -> Decision:
        """`resolve`'s spec and skipped rules, and per dimension what decided its entry."""
        if self.names is None:
            return Decision(PartitionSpec(), [], (), by_rules=False)
        effective = () if self.kind == "mesh" else effective_rules(rules, self.rules)
        if not effective:
            if self.kind == "logical" and require_rules:
                raise PlanError(
                    f"`{format_path(self.path)}` (shape {self.shape}) has the logical names "
                    f"{self.names} but no axis rules are set, so it has no mesh spec; pass "
                    f"rules=, or wrap the call in `with ml.axis_rules([('hidden', 'model'), "
                    f"...]):`"
                )
            written = tuple(_annotation_cause(name) for name in self.names)
            return Decision(PartitionSpec(*self.names), [], written, by_rules=False)
        # flax NNX: a name no rule names is a mesh axis; one whose rules could not apply
        # (skipped, or its axes taken by another dimension) is replicated, as in linen
        logical = {name for name, _ in effective} if self.kind == "nnx" else set(self.names)
        literal = tuple(
            axis
            for entry in self.names
            if entry not in logical
            for axis in (entry if isinstance(entry, tuple) else (entry,))
            if isinstance(axis, str)
        )
        assigned = assign(self.names, effective, mesh, literal)
        rule_names = [name for name, _ in effective]
        causes: list[str] = []
        for dim, name in enumerate(self.names):
            if not isinstance(name, str) or name not in logical:
                nnx_axis = isinstance(name, str) and self.kind == "nnx"
                causes.append(
                    _annotation_cause(name)
                    + (" (no rule's name, so flax NNX reads a mesh axis)" if nnx_axis else "")
                )
            elif assigned.given_by[dim] is not None:
                rule = assigned.given_by[dim]
                replicated = rule is not None and rule[1] is None
                causes.append(
                    f"the rule {rule!r} maps it to no mesh axis"
                    if replicated
                    else f"by the rule {rule!r}"
                )
            elif assigned.passed_over[dim]:
                causes.append("; ".join(assigned.passed_over[dim]))
            else:
                causes.append(
                    f"no rule names the logical name {name!r} ({did_you_mean(name, rule_names)}"
                    f"the rules name {', '.join(map(repr, dict.fromkeys(rule_names)))})"
                )
        spec = PartitionSpec(
            *(
                (None if name in logical else name) if axes is UNASSIGNED else axes
                for name, axes in zip(self.names, assigned.axes, strict=True)
            )
        )
        by_rules = any(isinstance(name, str) and name in logical for name in self.names)
        return Decision(spec, assigned.skipped, tuple(causes), by_rules)


class Decision(NamedTuple):
    """`Annotated.decide`: the mesh spec, the rules skipped because the mesh lacks their
    axes, per dimension what decided its entry (`"by the rule ('mlp', 'model')"`), and
    whether rules read some of its names as logical ones."""

    spec: PartitionSpec
    skipped: list[SkippedRule]
    causes: tuple[str, ...]
    by_rules: bool


def _annotation_cause(entry: Any) -> str:
    if entry is None:
        return "the annotation has None there"
    if entry is PartitionSpec.UNCONSTRAINED:
        return "the annotation leaves it to the compiler (UNCONSTRAINED)"
    return "as the annotation names it"


def effective_rules(explicit: Any, local: Any) -> tuple[tuple[str, Any], ...]:
    """The parameter's own rules, then the explicit rules if given, else those in context."""
    outer = check_rules(explicit) if explicit is not None else current_rules() or ()
    return tuple(local or ()) + tuple(outer)


def is_box(x: Any) -> bool:
    return isinstance(x, flax_meta.AxisMetadata | nnx.Variable)


def box_annotation(x: Any) -> dict[str, Any]:
    """Names, logical flag, rules and mesh of a flax box or NNX Variable (empty if none)."""
    if isinstance(x, nnx.Variable):
        return _nnx_annotation(x.get_metadata())
    if hasattr(x, "names"):  # nn.Partitioned, nn.LogicallyPartitioned
        from flax.linen import spmd as linen_spmd

        logical = isinstance(x, linen_spmd.LogicallyPartitioned)
        return {
            "names": tuple(x.names),
            "kind": "logical" if logical else "mesh",
            "rules": getattr(x, "rules", None),
            "mesh": x.mesh,
        }
    metadata = getattr(x, "metadata", None)
    if isinstance(x, flax_meta.AxisMetadata) and isinstance(metadata, dict):
        return _nnx_annotation(metadata)  # bridge.NNXMeta: an NNX Variable's metadata in linen
    return {}


def _nnx_annotation(md: dict[str, Any]) -> dict[str, Any]:
    sharding = md.get("out_sharding")
    if not sharding:
        return {}
    mesh = md.get("mesh")
    kind = "logical" if md.get("logical_names") else "nnx"
    if isinstance(sharding, NamedSharding):
        mesh, sharding, kind = sharding.mesh, sharding.spec, "mesh"
    return {
        "names": tuple(sharding),
        "kind": kind,
        "rules": md.get("sharding_rules"),
        "mesh": mesh,
    }


def box_value(x: Any) -> Any:
    if isinstance(x, nnx.Variable):
        return x.get_raw_value()
    if isinstance(x, flax_meta.AxisMetadata):
        unbox: Callable[..., Any] = x.unbox
        return unbox(apply_constraint=False) if _takes_constraint(x) else unbox()
    return x


def _takes_constraint(box: Any) -> bool:
    return isinstance(box, flax_meta.Partitioned)


def annotated_leaves(tree: Any) -> list[Annotated]:
    """Every array of `tree` with its path and annotation, in the tree's order.

    NNX graph nodes (modules, optimizers) are read through `nnx.graph.flatten`,
    so paths are the ones plans and transforms use (`linear1.kernel`).
    """
    out = []
    if graphlib.is_graph_node(tree) or isinstance(tree, nnx.Variable):
        pairs: list[tuple[Path, Any]] = variable_paths(tree)  # a shared Variable on each path
    else:
        with_paths, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
        pairs = [(tuple(key_name(k) for k in kp), leaf) for kp, leaf in with_paths]
    for path, leaf in pairs:
        value = box_value(leaf) if is_box(leaf) else leaf
        if _is_array(value):
            out.append(Annotated(path, value, leaf, **box_annotation(leaf)))
        elif isinstance(leaf, nnx.Variable):  # a Variable holding a pytree: each array of it
            for keys, array in jax.tree_util.tree_flatten_with_path(value)[0]:
                if _is_array(array):
                    within = tuple(key_name(k) for k in keys)
                    out.append(Annotated(path, array, leaf, within=within, **box_annotation(leaf)))
    return out


@dataclasses.dataclass(frozen=True)
class UnusedRule:
    """An axis rule whose logical name no parameter has, while a name close to it has no rule.

    Most likely a typo (`("mpl", "model")` for a model that says `mlp`): the
    parameters named `near` are less sharded than the rule meant. `str()` says so.
    """

    rule: tuple[str, MeshAxes]
    near: tuple[str, ...]

    def __str__(self) -> str:
        near = " or ".join(map(repr, self.near))
        return (
            f"axis rule {self.rule!r} names the logical name {self.rule[0]!r}, which no "
            f"parameter has (did you mean {near}? no rule names it), so the rule does nothing"
        )


def unused_rules(
    rules: tuple[tuple[str, MeshAxes], ...], used: Mapping[str, Sequence[str]]
) -> tuple[dict[UnusedRule, list[str]], list[str]]:
    """The rules whose name no parameter has: those like a typo, with the parameters left
    less sharded, and the names of the others (activations' names, for
    `ml.with_logical_constraint`, are named by no parameter: not an error).

    `used` maps each logical name the parameters have to their paths.
    """
    named = {name for name, _ in rules}
    unmapped = [name for name in used if name not in named]
    typos: dict[UnusedRule, list[str]] = {}
    others: list[str] = []
    for name, axes in rules:
        if name in used:
            continue
        near = tuple(difflib.get_close_matches(name, unmapped, n=2, cutoff=0.6))
        if near:
            paths = [path for n in near for path in used[n]]
            typos.setdefault(UnusedRule((name, axes), near), []).extend(paths)
        elif name not in others:
            others.append(name)
    return typos, others


def unused_rules_of(
    items: list[Annotated], rules: Any, mesh: Any = None
) -> tuple[dict[UnusedRule, list[str]], list[str]]:
    """The axis rules (`rules`, else those in context) whose name none of `items` has: those
    like a typo of a name with no rule, with the parameters' paths, and the other names
    (`unused_rules`). A mesh axis the mesh has is not a name that needs a rule."""
    outer = check_rules(rules) if rules is not None else current_rules() or ()
    axes = set(mesh if isinstance(mesh, Mapping) else getattr(mesh, "shape", ()))
    used: dict[str, list[str]] = {}
    for item in items:
        if item.kind == "mesh" or item.names is None:
            continue
        own = {name for name, _ in item.rules or ()}
        for name in item.names:
            if isinstance(name, str) and name not in own and name not in axes:
                used.setdefault(name, []).append(f"`{format_path(item.path)}`")
    return unused_rules(outer, used)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")
