"""The call plan a successful call leaves, with which the next call like it skips the lookup.

A call with positional arguments only, none static or nested, names where
its graph nodes sit and what type each argument has: a `speedups.CallPlan`
fixes these, so the next call whose arguments match runs the same entry
without flattening them again. Where the call wrote back only Variables'
arrays (no graph update, no graph node in its output) on a mesh the plan
can read, the plan also holds the slots its inputs are read from and its
outputs written to: such a call runs in two C steps (`meshlift.speedups`).

Example:

```python
import jax.numpy as jnp
from flax import nnx
import meshlift as ml

model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

@ml.jit
def scale(model):
    model.kernel[...] = model.kernel[...] * 2

scale(model)
plan = scale._plan
assert plan.node_positions == (0,) and plan.slot is not None  # the next call runs in C
scale(model)
```
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from jax.sharding import AbstractMesh, Mesh

from meshlift import compat, speedups
from meshlift.call.calls import Entry
from meshlift.call.layout import Call


def plan_after(entry: Entry, call: Call, mesh_option: Any) -> speedups.CallPlan | None:
    """The plan for calls like `call`, which ran `entry` and succeeded: None if such a
    call cannot skip the lookup (keywords, statics, nested arguments: `call.flat_positions`
    is None). The plan runs in C where `_runs_in_c` says how; else it only skips the
    lookup. `mesh_option` is the lifted function's `mesh=`."""
    positions = call.flat_positions
    if positions is None or entry.info is None:
        return None
    args = tuple(call.leaves)
    try:
        refs = tuple(weakref.ref(args[i]) for i in positions)
    except TypeError:  # a node that takes no weak reference
        return None
    layout = entry.layout
    runs = _runs_in_c(entry, mesh_option)
    if runs is None:  # it only skips the lookup
        runs, kept, donated, info = InC(), (), (), None
    else:
        kept, donated = (tuple(map(runs.variables.__getitem__, g)) for g in layout.var_groups)
        info = entry.info
    kept_dyn, donated_dyn = layout.dyn_groups  # positions of leaves, here of arguments
    return speedups.CallPlan(
        mesh_source=runs.mesh_source,
        mesh=runs.mesh,
        types=tuple(map(type, args)),
        node_positions=positions,
        node_refs=refs,
        unchanged=layout.split.unchanged,
        slot=runs.slot,
        variables=kept,
        dyn_positions=kept_dyn,
        donated_variables=donated,
        donated_dyn_positions=donated_dyn,
        info=info,
        changed=entry.info.changed,
        targets=runs.targets,
        array_type=runs.array_type,
        staged=entry.staged,
        entry=entry,
    )


class InC(NamedTuple):
    """How the C steps run calls like the last one (`InC()`: they do not)."""

    mesh_source: Callable[[], Any] | None = None  # None: `mesh` is the call's mesh
    mesh: Any = None
    slot: Any = None  # where each Variable's array is read from and written to
    variables: tuple[Any, ...] = ()  # the Variables the inputs are read from, split order
    targets: tuple[Any, ...] = ()  # the Variables the changed outputs are written to
    array_type: type | None = None


def _runs_in_c(entry: Entry, mesh_option: Any) -> InC | None:
    """How the C steps run calls like the last one, which ran `entry`; None where they
    cannot."""
    layout, info = entry.layout, entry.info
    assert info is not None
    if info.update is not None or info.outputs.graphdefs or info.container is not None:
        return None
    access, array_type = layout.split.slot_access(info.changed), compat.array_type()
    if access is None or array_type is None:
        return None
    mesh_source: Callable[[], Any] | None
    if mesh_option is None:  # the call site's mesh, as jax's reader gives it
        mesh_source = compat.mesh_reader()
        try:
            mesh = mesh_source()
        except Exception:  # refused inside a trace
            return None
    else:
        mesh_source = None if isinstance(mesh_option, Mesh | AbstractMesh) else mesh_option
        mesh = layout.mesh
    slot, variables, targets = access
    if not all(type(value) is array_type for value in speedups.read_each(slot, targets)):
        return None  # a typed key, a container changed in place: each call would miss
    return InC(mesh_source, mesh, slot, variables, targets, array_type)
