"""PartitionSpec checks: every reason a spec cannot shard an array on a mesh.

Example:

```python
from jax.sharding import PartitionSpec as P
from meshlift.plans.specs import spec_problems

assert spec_problems(P("data"), (8, 3), {"data": 2}) == []
assert "not divisible" in spec_problems(P("data"), (7, 3), {"data": 2})[0]
```
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence

from jax.sharding import PartitionSpec


def entries(spec: PartitionSpec) -> tuple[object, ...]:
    """One entry per dimension (`spec.partitions`: a spec with `unreduced` axes refuses
    to be iterated; those axes name no dimension)."""
    return tuple(getattr(spec, "partitions", spec))


def spec_axes(spec: PartitionSpec) -> list[tuple[int, tuple[str, ...]]]:
    """`P(None, ("data", "model"))` -> `[(0, ()), (1, ("data", "model"))]`."""
    out: list[tuple[int, tuple[str, ...]]] = []
    for dim, entry in enumerate(entries(spec)):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append((dim, ()))
        elif isinstance(entry, str):
            out.append((dim, (entry,)))
        else:
            out.append((dim, tuple(entry)))  # type: ignore[arg-type]
    return out


def repeats_an_axis(spec: PartitionSpec) -> bool:
    """Whether `spec` names a mesh axis twice (jax's `DuplicateSpecError`)."""
    axes = [axis for _, dim_axes in spec_axes(spec) for axis in dim_axes]
    return len(set(axes)) < len(axes)


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """`"did you mean 'model'? "` for the name in `names` closest to a misspelled `name`;
    empty if none is close."""
    near = difflib.get_close_matches(name, list(names), n=1)
    return f"did you mean {near[0]!r}? " if near else ""


def spec_problems(
    spec: PartitionSpec,
    shape: Sequence[int] | None,
    mesh_shape: Mapping[str, int],
    what: str = "sharding",
) -> list[str]:
    """Every reason `spec` cannot shard an array of `shape` on a mesh; empty if it can.

    With `shape` None (not known yet) only the mesh-axis checks apply.
    """
    problems = []
    rank = len(entries(spec))
    if shape is None:
        shape = (0,) * rank
    if rank > len(shape):
        problems.append(
            f"the spec has {rank} entries but the array has rank {len(shape)}; "
            f"use at most {len(shape)} entries"
        )
    seen: set[str] = set()
    for dim, axes in spec_axes(spec):
        for axis in axes:
            if axis not in mesh_shape:
                problems.append(
                    f"mesh axis {axis!r} is not in the mesh (axes {list(mesh_shape)}); "
                    f"{did_you_mean(axis, mesh_shape)}did you forget to declare the mesh? Use "
                    f"one of its axis names or a mesh that has it"
                )
            elif axis in seen:
                problems.append(
                    f"mesh axis {axis!r} is used twice: a single {what} specification can map "
                    f"every mesh axis to at most one positional dimension"
                )
            seen.add(axis)
        size = math.prod(mesh_shape.get(axis, 1) for axis in axes)
        if dim < len(shape) and axes and shape[dim] % size:
            problems.append(
                f"dimension {dim} (size {shape[dim]}) is not divisible by {size}, the size of "
                f"mesh axes {axes}; pad the array or choose other axes"
            )
    return problems
