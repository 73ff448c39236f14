"""Why a parameter has its spec: what decided it, and why each dimension is split or not.

What decides a spec is a plan's filter (the first that matches; later ones that
match too are noted), the plan's `...`, an annotation's logical names under the
axis rules, an annotation naming mesh axes, or nothing (no annotation:
replicated). Each dimension is split over its mesh axes, or not, for a reason:
the spec has None there, no rule names its logical name, a rule was skipped
(the mesh lacks its axis) or passed over (its axis splits another dimension),
or the split does not fit (an axis the mesh lacks, a size not divisible).
`ml.explain` gives every row a `Why`; `Explanation.why(path)` and
`meshlift plan --why PATH` print it.

Example:

```python
from flax import nnx
import meshlift as ml

init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
model = nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))
report = ml.explain(model, [("embed", None), ("mlp", "model")], {"data": 2, "model": 4})
assert report.row("kernel").why.source == "rules"
print(report.why("kernel"))   # dim 1 (size 64): split 4 ways over 'model', by the rule ...
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from meshlift.plans.sharding import StateSharding, is_path_filter
from meshlift.plans.specs import did_you_mean, entries


@dataclasses.dataclass(frozen=True)
class Why:
    """What decided one parameter's spec, and per dimension why it is split or not.

    Attributes:
        source: The table's short word for it: `"filter 2"` (the plan's second
            filter), `"..."`, `"rules"`, `"annotation"`, `"none"` or `"error"`.
        decided_by: One sentence: which filter, annotation or rules, and the spec.
        dimensions: One line per dimension: split how, or not, and why.
        notes: Later filters that match too, filters that match nothing but look meant.
    """

    source: str
    decided_by: str
    dimensions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"decided by: {self.decided_by}"]
        lines += [f"  {line}" for line in self.dimensions]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def of_filter(
    plan: StateSharding,
    index: int,
    path: tuple[Any, ...],
    value: Any,
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
    matched: set[int],
) -> Why:
    """The `Why` of a parameter whose spec is the plan's rule `index`.

    `matched` holds the rules that match any parameter, for the note on a path filter
    that matches nothing but names something like this parameter.
    """
    path = (*plan.root, *path)  # as `rule_for` asks the filters
    filter_, _, spec = plan.rules[index]
    count = len(plan.rules)
    if filter_ is Ellipsis:
        source, decided = "...", f"the plan's `...` (no filter before it matches): {spec}"
    else:
        source = f"filter {index + 1}"
        decided = f"filter {index + 1} of {count} in the plan, {filter_text(filter_)}: {spec}"
    notes = [
        f"filter {j + 1}, {filter_text(f)} ({s}), matches it too, but filter {index + 1} "
        f"comes first"
        for j, (f, predicate, s) in enumerate(plan.rules)
        if j > index and f is not Ellipsis and predicate(path, value)
    ]
    if filter_ is Ellipsis and path:
        notes += [
            f"filter {j + 1}, {f!r}, matches no parameter; {hint.strip()}"
            for j, (f, _, _) in enumerate(plan.rules)
            if j not in matched and is_path_filter(f)
            for hint in [_near_part(f, path)]
            if hint
        ]
    if isinstance(spec, NamedSharding):
        mesh_shape, spec = dict(spec.mesh.shape), spec.spec
    if not isinstance(spec, PartitionSpec):
        return Why(
            source,
            decided,
            ("every dimension: left to the compiler (no spec)",),
            notes=tuple(notes),
        )
    causes = [_spec_cause(spec, dim) for dim in range(len(shape))]
    return Why(source, decided, dimension_lines(spec, shape, mesh_shape, causes), tuple(notes))


def _spec_cause(spec: PartitionSpec, dim: int) -> str:
    """What a plan's spec says of dimension `dim`."""
    written = entries(spec)
    if not written:
        return f"the spec {spec} splits nothing"
    if dim >= len(written):
        return f"the spec has {len(written)} entries, none for it"
    return "the spec has None there" if written[dim] is None else "by the spec"


def of_annotation(
    names: tuple[Any, ...] | None,
    by_rules: bool,
    spec: PartitionSpec,
    causes: Sequence[str],
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
) -> Why:
    """The `Why` of a parameter whose spec its annotation gives (under rules, where they
    read its names as logical ones); `causes` says per dimension what decided it
    (`Annotated.decide`)."""
    if names is None:
        return Why(
            "none",
            f"no annotation, so {spec}: replicated (annotate it, or give a plan with a filter "
            f"for it)",
            dimension_lines(spec, shape, mesh_shape, ["it has no annotation"] * len(shape)),
        )
    if by_rules:
        source, decided = "rules", f"the annotation {names}, logical names, and the rules: {spec}"
    else:
        source, decided = "annotation", f"the annotation {names}, mesh axes: {spec}"
    return Why(source, decided, dimension_lines(spec, shape, mesh_shape, causes))


def dimension_lines(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
    causes: Sequence[str],
) -> tuple[str, ...]:
    """One line per dimension: `"dim 1 (size 64): split 4 ways over 'model', by the rule
    ('mlp', 'model')"`, or not split and why, or what keeps the split from fitting."""
    written = entries(spec)
    lines = []
    for dim, size in enumerate(shape):
        entry = written[dim] if dim < len(written) else None
        cause = causes[dim] if dim < len(causes) else ""
        axes: tuple[str, ...] = (
            ()
            if entry is None or entry is PartitionSpec.UNCONSTRAINED
            else ((entry,) if isinstance(entry, str) else tuple(entry))  # type: ignore[arg-type]
        )
        missing = [a for a in axes if a not in mesh_shape]
        ways = math.prod(mesh_shape.get(a, 1) for a in axes)
        over = " x ".join(map(repr, axes))
        if entry is PartitionSpec.UNCONSTRAINED:
            verdict = "left to the compiler"
        elif missing:
            guess = did_you_mean(missing[0], mesh_shape).strip()
            verdict = f"✗ names the mesh axis {missing[0]!r}, which the mesh lacks" + (
                f" ({guess})" if guess else ""
            )
        elif axes and size % ways:
            verdict = f"✗ split {ways} ways over {over}, but {size} is not divisible by {ways}"
        elif axes:
            verdict = f"split {ways} ways over {over}"
        else:
            verdict = "not split"
        lines.append(f"dim {dim} (size {size}): {verdict}" + (f", {cause}" if cause else ""))
    return tuple(lines)


def filter_text(filter_: Any) -> str:
    """A filter as a user writes it: `nnx.Param` for a Variable type, else its repr."""
    if isinstance(filter_, type):
        prefix = "nnx." if filter_.__module__.startswith("flax.nnx") else ""
        return prefix + filter_.__qualname__
    return repr(filter_)


def _near_part(filter_: Any, path: tuple[Any, ...]) -> str:
    """`"did you mean 'kernel'? "` where a path filter's last part is close to `path`'s."""
    parts = getattr(filter_, "parts", None) or getattr(filter_, "prefix", ())
    if not parts:
        return ""
    last = str(path[-1])
    return did_you_mean(str(parts[-1]), [last]) if str(parts[-1]) != last else ""
