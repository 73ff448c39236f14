"""Logical axis rules: name array dimensions once, map the names to mesh axes in one place.

Rules are an ordered list of `(logical_name, mesh_axes)` pairs. A logical
name may appear several times, as fallbacks. Rules are applied in order: a
rule gives its mesh axes to its dimension if that dimension has none yet, the
axes exist (in the mesh, when a mesh is known) and no other dimension of the
same array already uses them. A rule skipped because the mesh lacks its axes is
reported (`ml.AxisRuleWarning`, or an error with `strict=True`): it is usually
a typo. A name with no rule is replicated, and no spec
ever uses a mesh axis twice (flax's linen semantics; NNX's resolver can
return `P('model', 'model')`). A rule may map a name to
`PartitionSpec.UNCONSTRAINED` (the compiler chooses that dimension), as in flax.

There is one rules context, flax's: `ml.axis_rules`, `meshlift.plans.logical.set_axis_rules`,
flax's `nn.logical_axis_rules` and `meshlift.partitioning.axis_rules` (the
`flax.linen.partitioning` names) all set it, and meshlift and flax's own
helpers (`nn.with_logical_constraint`, `param_with_axes`, ...) all read it.

Example:

```python
import meshlift as ml
from jax.sharding import PartitionSpec as P

rules = [("embed", "data"), ("embed", "model"), ("mlp", "model")]
assert ml.logical_to_mesh(("mlp", "embed"), rules) == P("model", "data")
with ml.axis_rules(rules):
    assert ml.logical_to_mesh(P("embed", "vocab")) == P("data", None)
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias, overload

import jax
from flax.core import spmd as flax_spmd
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from meshlift.errors import AxisRuleWarning, PlanError
from meshlift.paths import user_stacklevel
from meshlift.plans.mesh import current_mesh
from meshlift.plans.specs import did_you_mean

MeshAxes: TypeAlias = str | tuple[str, ...] | None  # or PartitionSpec.UNCONSTRAINED
Rules: TypeAlias = Sequence[tuple[str, MeshAxes]]

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED
_FALLBACKS = ("axis_is_unsharded", "raise_error", "no_constraint")  # flax's RulesFallback values


def check_rules(rules: Any) -> tuple[tuple[str, MeshAxes], ...]:
    """`rules` as a tuple of `(name, mesh_axes)` pairs; an error saying what is wrong.

    A TypeError for a malformed rule, a ValueError for a rule whose mesh axes
    repeat an axis (`("batch", ("x", "x"))`: no dimension can be split over
    one mesh axis twice).
    """
    if isinstance(rules, str | Mapping) or not isinstance(rules, Sequence):
        raise TypeError(
            f"axis rules must be a list of (logical_name, mesh_axes) pairs, got "
            f"{type(rules).__name__}: {rules!r}; write [('batch', 'data'), ('hidden', 'model')]"
        )
    out: list[tuple[str, Any]] = []
    for rule in rules:
        if not (isinstance(rule, Sequence) and not isinstance(rule, str) and len(rule) == 2):
            raise TypeError(
                f"axis rule {rule!r} is not a (logical_name, mesh_axes) pair; write "
                f"('hidden', 'model'), ('hidden', ('data', 'model')) or ('hidden', None)"
            )
        name, axes = rule
        if isinstance(axes, list):
            axes = tuple(axes)
        if not isinstance(name, str) or not (
            axes is None
            or axes is UNCONSTRAINED
            or isinstance(axes, str)
            or (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes))
        ):
            raise TypeError(
                f"axis rule {rule!r}: the logical name must be a string and the mesh axes a "
                f"string, a tuple of strings, None or PartitionSpec.UNCONSTRAINED"
            )
        if isinstance(axes, tuple) and len(set(axes)) < len(axes):
            repeated = sorted({a for a in axes if axes.count(a) > 1})
            once = tuple(dict.fromkeys(axes))
            raise ValueError(
                f"axis rule {rule!r} uses the mesh axis {repeated[0]!r} twice; a dimension is "
                f"split over each mesh axis at most once: write "
                f"{(name, once[0] if len(once) == 1 else once)!r}"
            )
        out.append((name, axes))
    return tuple(out)


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[tuple[tuple[str, MeshAxes], ...]]:
    """Set the logical axis rules for the block; checked here, refused if malformed.

    The rules go into flax's one rules context, so flax's helpers
    (`nn.with_logical_constraint`, `nn.logical_to_mesh_sharding`,
    `param_with_axes`) see them too, and rules set by flax's
    `nn.logical_axis_rules` are seen by meshlift. The block yields the
    rules as checked (a tuple of pairs).

    Args:
        rules: `(logical_name, mesh_axes)` pairs, in order; mesh axes are a name, a
            tuple of names, None or `PartitionSpec.UNCONSTRAINED`.

    Yields:
        The rules as checked, a tuple of pairs.

    Raises:
        TypeError: If `rules` are not a sequence of well-formed pairs.
        ValueError: If a rule repeats a mesh axis.

    Example:

    ```python
    init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    abstract_variables = nnx.eval_shape(
        lambda: nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
    )
    with ml.axis_rules([("batch", "data"), ("hidden", "model")]):
        specs = ml.get_partition_spec(abstract_variables)   # NNX: resolved, as nnx's is
    assert specs["kernel"].get_value() == P(None, "model")
    ```
    """
    checked = check_rules(rules)
    # stored as given, as flax's own context stores them (`get_axis_rules()` returns them)
    with flax_spmd.logical_axis_rules(rules):
        yield checked


def set_axis_rules(rules: Rules) -> None:
    """Set the logical axis rules from here on (flax's `set_axis_rules`), after checking them.

    Example:

    ```python
    from meshlift.plans.logical import get_axis_rules, set_axis_rules

    set_axis_rules((("batch", "data"),))
    assert get_axis_rules() == (("batch", "data"),)
    assert ml.logical_to_mesh(("batch", None)) == P("data", None)
    set_axis_rules(())
    ```
    """
    check_rules(rules)
    flax_spmd.set_logical_axis_rules(rules)


def get_axis_rules() -> Any:
    """The logical axis rules in context, as they were given (`()` when none are set)."""
    return flax_spmd.get_logical_axis_rules()


def current_rules() -> tuple[tuple[str, MeshAxes], ...] | None:
    """The rules in context (`ml.axis_rules` or flax's), checked; None when none are set."""
    rules = flax_spmd.get_logical_axis_rules()
    return check_rules(rules) if rules else None


def _axes_of(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None or axes is UNCONSTRAINED:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _mesh_shape(mesh: Any) -> dict[str, int] | None:
    """`{axis: size}` of a Mesh, an AbstractMesh or such a dict; None for no mesh."""
    if mesh is None:
        return None
    return dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)


@dataclasses.dataclass(frozen=True)
class SkippedRule:
    """An axis rule passed over for a dimension it named, because the mesh lacks `missing`.

    `mesh_shape` is the mesh's `{axis: size}`. `str()` says which rule and axis,
    and which mesh axis the name might have meant.
    """

    rule: tuple[str, MeshAxes]
    missing: tuple[str, ...]
    mesh_shape: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        guess = did_you_mean(self.missing[0], (name for name, _ in self.mesh_shape))
        hint = f" ({guess.strip()})" if guess else ""
        which = " and ".join(map(repr, self.missing))
        return (
            f"axis rule {self.rule!r} names the mesh axis {which}{hint}, which the mesh "
            f"{dict(self.mesh_shape)} lacks, so the rule is skipped"
        )


def report_skipped(skipped: Mapping[Any, Sequence[str]], *, strict: bool) -> None:
    """Say which rules were skipped or do nothing, and for what: an AxisRuleWarning, or with
    `strict` a PlanError.

    `skipped` maps each rule (a `SkippedRule`, an `annotation.UnusedRule`) to what it was
    skipped for (parameter paths or logical names, as the reader knows them).
    """
    if not skipped:
        return
    lines = [f"{rule} for {', '.join(dict.fromkeys(where))}" for rule, where in skipped.items()]
    message = "\n".join(lines) + "; these are less sharded than the rules ask. Fix the rule"
    if strict:
        raise PlanError(message + " (strict=True makes such a rule an error).")
    warnings.warn(
        message + "; if the rules also serve another mesh or model, filter "
        "ml.AxisRuleWarning, or pass strict=True to make this an error.",
        AxisRuleWarning,
        stacklevel=user_stacklevel(),
    )


@overload
def logical_to_mesh_axes(
    names: Sequence[str | None] | PartitionSpec,
    rules: Rules | None = None,
    *,
    mesh: Any = None,
    strict: bool = False,
) -> PartitionSpec: ...


@overload
def logical_to_mesh_axes(
    names: None, rules: Rules | None = None, *, mesh: Any = None, strict: bool = False
) -> None: ...


def logical_to_mesh_axes(
    names: Sequence[str | None] | PartitionSpec | None,
    rules: Rules | None = None,
    *,
    mesh: Any = None,
    strict: bool = False,
) -> PartitionSpec | None:
    """The mesh `PartitionSpec` for one array whose dimensions have logical `names`.

    `rules` default to those in context (`ml.axis_rules`). With a `mesh` (a
    Mesh or `{"data": 2, ...}`), a rule whose mesh axes the mesh lacks is
    skipped, so a later fallback applies, and an `ml.AxisRuleWarning` says so
    (with `strict=True`, a PlanError: a skipped rule is usually a typo).
    Entries that are not names (None, `PartitionSpec.UNCONSTRAINED`) are
    kept, and a rule may give `PartitionSpec.UNCONSTRAINED`, as in flax.

    Args:
        names: One logical name, None or `PartitionSpec.UNCONSTRAINED` per dimension.
        rules: Axis rules; None: those in context.
        mesh: A Mesh or `{"data": 2, ...}` to check the rules' axes against; None: no
            check.
        strict: Make a skipped rule a `PlanError` instead of an `ml.AxisRuleWarning`.

    Returns:
        The mesh `PartitionSpec`; None if `names` is None.

    Raises:
        TypeError: If `rules` are malformed.
        ValueError: If a rule repeats a mesh axis, or a name names two dimensions.
        meshlift.PlanError: With `strict=True`, if a rule is skipped.

    Example:

    ```python
    rules = [("embed", "data"), ("embed", "model"), ("mlp", "model")]
    assert ml.logical_to_mesh_axes(("mlp", "embed"), rules) == P("model", "data")
    free = ml.logical_to_mesh_axes(("embed", "seq"), [("seq", P.UNCONSTRAINED)])
    assert free == P(None, P.UNCONSTRAINED)
    ```
    """
    if names is None:
        return None
    skipped: dict[SkippedRule, list[str]] = {}
    spec = _to_mesh_axes(tuple(names), _resolve_rules(rules), mesh, skipped)
    report_skipped(skipped, strict=strict)
    return spec


def _to_mesh_axes(
    names: tuple[Any, ...],
    rules: tuple[tuple[str, MeshAxes], ...],
    mesh: Any,
    skipped: dict[SkippedRule, list[str]],
) -> PartitionSpec:
    """The spec of logical `names`; the rules the mesh made `assign` skip go in `skipped`."""
    assigned = assign(names, rules, mesh)
    for rule in assigned.skipped:
        skipped.setdefault(rule, []).append(f"the logical names {names}")
    return PartitionSpec(*(None if a is UNASSIGNED else a for a in assigned.axes))


UNASSIGNED = object()  # a logical name no rule has given mesh axes to (yet)


class Assignment(NamedTuple):
    """What `assign` decided for each dimension of one array.

    `axes`: its mesh axes, or `UNASSIGNED` for a name no rule fits; `skipped`: the
    rules skipped because the mesh lacks their axes; `given_by`: the rule that gave
    each dimension its axes (None: none did); `passed_over`: per dimension, why each
    rule naming it did not apply (`ml.explain` says it).
    """

    axes: list[Any]
    skipped: list[SkippedRule]
    given_by: list[tuple[str, MeshAxes] | None]
    passed_over: list[list[str]]


def assign(
    names: tuple[Any, ...],
    rules: tuple[tuple[str, MeshAxes], ...],
    mesh: Any,
    taken: tuple[str, ...] = (),
) -> Assignment:
    """The mesh axes of each dimension of an array whose dimensions have logical `names`.

    Entries that are not names (None, `PartitionSpec.UNCONSTRAINED`) are kept as they are.
    `taken` are mesh axes other dimensions already use (named as mesh axes), which no
    rule may give again. A rule is skipped only where it would have applied: its name's
    dimension has no axes yet and none of its axes is used by another dimension.
    """
    seen: set[str] = set()
    for name in names:
        if isinstance(name, str):
            if name in seen:
                raise ValueError(
                    f"logical name {name!r} names two dimensions of {names}; each logical name "
                    f"may name one dimension of an array (rename one of them)"
                )
            seen.add(name)
    result: list[Any] = [UNASSIGNED if isinstance(n, str) else n for n in names]
    owner: dict[str, str] = {axis: "the annotation, for another dimension" for axis in taken}
    mesh_shape = _mesh_shape(mesh)
    skipped: list[SkippedRule] = []
    given_by: list[tuple[str, MeshAxes] | None] = [None] * len(names)
    passed_over: list[list[str]] = [[] for _ in names]
    for name, axes in rules:
        if name not in seen:
            continue
        dim = names.index(name)
        wanted = _axes_of(axes)
        if result[dim] is not UNASSIGNED:
            continue
        used = [a for a in wanted if a in owner]
        if used:
            passed_over[dim].append(
                f"the rule {(name, axes)!r} is passed over: mesh axis {used[0]!r} is taken by "
                f"{owner[used[0]]}"
            )
            continue
        if mesh_shape is not None and not set(mesh_shape).issuperset(wanted):
            missing = tuple(a for a in wanted if a not in mesh_shape)
            rule = SkippedRule((name, axes), missing, tuple(mesh_shape.items()))
            skipped.append(rule)
            passed_over[dim].append(str(rule))
            continue
        result[dim] = axes
        given_by[dim] = (name, axes)
        owner.update((a, f"the rule {(name, axes)!r}, for dimension {dim}") for a in wanted)
    return Assignment(result, skipped, given_by, passed_over)


def _is_logical_leaf(x: Any) -> bool:
    return (
        x is None
        or isinstance(x, PartitionSpec)
        or (
            isinstance(x, tuple)
            and all(e is None or e is UNCONSTRAINED or isinstance(e, str) for e in x)
        )
    )


def logical_to_mesh(
    specs: Any, rules: Rules | None = None, *, mesh: Any = None, strict: bool = False
) -> Any:
    """Map logical specs to mesh specs: one spec, or a pytree of them (`P` or name tuples).

    `mesh` and `strict` as for `logical_to_mesh_axes`.

    Args:
        specs: A `PartitionSpec` or tuple of logical names, or a pytree of them (None
            leaves stay None).
        rules: Axis rules; None: those in context.
        mesh: A Mesh or `{"data": 2, ...}` to check the rules' axes against; None: no
            check.
        strict: Make a skipped rule a `PlanError` instead of an `ml.AxisRuleWarning`.

    Returns:
        The mesh `PartitionSpec`, or the same pytree of them.

    Raises:
        TypeError: If `rules` are malformed.
        ValueError: If a rule repeats a mesh axis, or a name names two dimensions.
        meshlift.PlanError: With `strict=True`, if a rule is skipped.

    Example:

    ```python
    specs = ml.logical_to_mesh({"w": P("embed", "mlp"), "b": P("mlp")}, [("mlp", "model")])
    assert specs == {"w": P(None, "model"), "b": P("model")}
    ```
    """
    rules = _resolve_rules(rules)
    skipped: dict[SkippedRule, list[str]] = {}

    def to_mesh(names: Any) -> PartitionSpec | None:
        return None if names is None else _to_mesh_axes(tuple(names), rules, mesh, skipped)

    if _is_logical_leaf(specs):
        resolved = to_mesh(specs)
    else:
        resolved = jax.tree.map(to_mesh, specs, is_leaf=_is_logical_leaf)
    report_skipped(skipped, strict=strict)
    return resolved


def logical_to_mesh_sharding(
    specs: Any, mesh: Mesh, rules: Rules | None = None, *, strict: bool = False
) -> Any:
    """Like `logical_to_mesh`, giving a `NamedSharding` on `mesh` per spec.

    Args:
        specs: A `PartitionSpec` or tuple of logical names, or a pytree of them.
        mesh: The mesh of the shardings; rules naming axes it lacks are skipped.
        rules: Axis rules; None: those in context.
        strict: Make a skipped rule a `PlanError` instead of an `ml.AxisRuleWarning`.

    Returns:
        A `NamedSharding`, or the same pytree of them (None leaves stay None).

    Raises:
        TypeError: If `rules` are malformed.
        ValueError: If a rule repeats a mesh axis, or a name names two dimensions.
        meshlift.PlanError: With `strict=True`, if a rule is skipped.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    sharding = ml.logical_to_mesh_sharding(P("batch", "hidden"), mesh, [("batch", "data")])
    assert sharding == jax.NamedSharding(mesh, P("data", None))
    ```
    """
    resolved = logical_to_mesh(specs, rules, mesh=mesh, strict=strict)
    return jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s),
        resolved,
        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
    )


def with_logical_constraint(
    x: Any,
    names: Any,
    rules: Rules | None = None,
    mesh: Mesh | None = None,
    fallback: Any = "axis_is_unsharded",
) -> Any:
    """`jax.lax.with_sharding_constraint` with logical dimension names (flax's semantics).

    The mesh is `mesh=`, else the one of `ml.use_mesh` (`jax.set_mesh`),
    else the deprecated `with mesh:` context; with none, `x` is returned
    unchanged (one device: nothing to constrain); with no rules at all, too (as in
    flax). `x` may be a pytree, with `names` a matching tree of name tuples.
    A name may be `PartitionSpec.UNCONSTRAINED` (the compiler chooses).

    `fallback` says what a name that no rule maps does, as flax's
    `RulesFallback` (its members or their values): `"axis_is_unsharded"`
    (default: replicated along it), `"raise_error"` (a ValueError, also
    without a mesh), `"no_constraint"` (that array is left unconstrained).

    Args:
        x: An array, or a pytree of arrays.
        names: One logical name per dimension of `x`, or a tree of them matching `x`;
            None: `x` unchanged.
        rules: Axis rules; None: those in context.
        mesh: The mesh; None: the one in context.
        fallback: A flax `RulesFallback` or its value, for a name no rule maps.

    Returns:
        `x` constrained (or unchanged, as above).

    Raises:
        TypeError: If `rules` are malformed.
        ValueError: If `fallback` is unknown (checked when rules are set), a rule
            repeats a mesh axis, a name names two dimensions, or, with `"raise_error"`,
            a name no rule maps.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with ml.use_mesh(mesh), ml.axis_rules([("batch", "data")]):
        y = ml.with_logical_constraint(jnp.ones((8, 16)), ("batch", "embed"))   # P('data', None)
        z = ml.with_logical_constraint(y, ("batch", P.UNCONSTRAINED))   # P('data', UNCONSTRAINED)
        same = ml.with_logical_constraint(y, ("batch", "embed"), fallback="no_constraint")
    ```
    """
    rules = _resolve_rules(rules)
    if names is None or not rules:
        return x
    mode = _check_fallback(fallback)
    manual = _manual_axes()
    context: Mesh | AbstractMesh | None = mesh if mesh is not None else current_mesh(legacy=True)
    if manual:  # inside shard_map: constrain the auto axes of the mesh in context only
        context = jax.sharding.get_abstract_mesh()

    def constrain(spec_names: Any, value: Any) -> Any:
        if spec_names is None:
            return value
        assigned, passed_over, _, _ = assign(tuple(spec_names), rules, context)
        report_skipped(
            {rule: [f"the logical names {tuple(spec_names)}"] for rule in passed_over}, strict=False
        )
        missing = [n for n, a in zip(tuple(spec_names), assigned, strict=True) if a is UNASSIGNED]
        if missing and mode == "raise_error":
            raise ValueError(
                f"logical names {tuple(spec_names)} did not match a rule: no rule gives mesh "
                f"axes to {', '.join(map(repr, missing))} (rules: {rules}"
                + (
                    f", mesh axes: {sorted(_mesh_shape(context) or ())}"
                    if context is not None
                    else ""
                )
                + "); add a rule such as ('name', 'model'), or pass "
                "fallback=RulesFallback.AXIS_IS_UNSHARDED to replicate along it"
            )
        if (missing and mode == "no_constraint") or context is None:
            return value
        spec = PartitionSpec(*(None if a is UNASSIGNED else a for a in assigned))
        if manual:
            if manual.issuperset(context.axis_names):
                return value  # fully manual: each device holds its block, nothing to constrain
            return jax.lax.with_sharding_constraint(value, _without_axes(spec, manual))
        return jax.lax.with_sharding_constraint(value, NamedSharding(context, spec))

    if _is_logical_leaf(names):
        if hasattr(x, "shape"):
            return constrain(names, x)
        return jax.tree.map(lambda v: constrain(names, v), x)
    return jax.tree.map(constrain, names, x, is_leaf=_is_logical_leaf)


def _manual_axes() -> frozenset[str]:
    """The mesh axes that are manual where this runs (inside `shard_map`); empty elsewhere."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _without_axes(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
    """`spec` with `axes` taken out: inside shard_map a manual axis is split already."""

    def entry(e: Any) -> Any:
        if isinstance(e, str):
            return None if e in axes else e
        if isinstance(e, tuple):
            kept = tuple(a for a in e if a not in axes)
            return kept if len(kept) > 1 else kept[0] if kept else None
        return e  # None, UNCONSTRAINED

    return PartitionSpec(*map(entry, spec))


def _check_fallback(fallback: Any) -> str:
    """The value of a flax `RulesFallback` (or the value itself); a ValueError if unknown."""
    value = getattr(fallback, "value", fallback)
    if value not in _FALLBACKS:
        raise ValueError(
            f"fallback={fallback!r} is not one of flax's RulesFallback values {_FALLBACKS}; "
            f"pass e.g. flax.linen.spmd.RulesFallback.NO_CONSTRAINT or 'no_constraint'"
        )
    return value


def _resolve_rules(rules: Rules | None) -> tuple[tuple[str, MeshAxes], ...]:
    if rules is None:
        return current_rules() or ()
    return check_rules(rules)
