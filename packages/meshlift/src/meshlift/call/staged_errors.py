"""JAX's errors about a staged function, in the caller's names.

A lifted call hands JAX a pure function of four tuples (`kept_vars`,
`kept_dyn`, `donated_vars`, `donated_dyn`; see `meshlift.call.pure`), whose
inputs JAX is told by the caller's names (`m.kernel`), so its own messages
use them. When JAX refuses a call, meshlift checks what it can in the
caller's terms: each Variable's array and each argument against its spec on
the mesh, and, if the trace got past the lifted function, the output against
the output specs. A problem found is raised as a `PlanError` naming the
path, with JAX's error as its cause. Otherwise JAX's error stands word for
word, and where it names the staged function's outputs
(`out_shardings[0][1]`), a note says whose they are.

Example:

```python
import jax.numpy as jnp
import pytest
import meshlift as ml
from jax.sharding import PartitionSpec as P

mesh = ml.make_mesh({"data": 2, "model": 4})
f = ml.jit(lambda batch: batch * 2, in_shardings=P("model"), mesh=mesh)
with pytest.raises(ml.PlanError, match="batch"):
    f(jnp.ones(6))                  # 6 rows do not divide over 4 devices
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from meshlift.call.pure import RETURNED, RUNNING, abstract_outputs, last_trace
from meshlift.errors import PlanError
from meshlift.paths import format_path
from meshlift.plans import resolve

_OUTPUT_NAMES = ("out_shardings", "out_specs")  # JAX's names for the output's specs
_NAMES_SHOWN = 12  # entries a note lists at most


@contextlib.contextmanager
def named_errors(layout: Any, call: Any = None) -> Iterator[None]:
    """Errors raised inside, told in `layout`'s caller names (see the module)."""
    try:
        yield
    except Exception as error:
        explain(layout, error, call)
        raise


def explain(layout: Any, error: BaseException, call: Any) -> None:
    """Raise a PlanError naming the argument or output JAX refused in `error`, if the plan
    shows one; else note whose are the staged names `error` shows. Without this call's
    leaves (`call` None) only the Variables are checked."""
    trace = last_trace(layout.key)
    if trace != RUNNING and isinstance(error, ValueError):  # a PlanError is a ValueError
        problem = _plan_problem(layout, call, check_output=trace == RETURNED)
        if problem is not None:
            raise problem from error
    message = str(error)
    notes = (names_note(layout, message), axis_types_note(layout.mesh, message))
    for note in (*notes, manual_axes_note(layout.names, message)):
        if note:
            error.add_note(note)


def manual_axes_note(names: Any, message: str) -> str | None:
    """What to change where JAX refused to leave shard_map's manual axes inside the function
    (flax's `nnx.Embed` called with `out_sharding=` does: `nnx.shard_map` fails alike)."""
    if "Going from `Manual` AxisType" not in message:
        return None
    return (
        f"meshlift: a call inside {names.function} switches every mesh axis to Auto or "
        f"Explicit (`jax.sharding.auto_axes` without `axes=`), and under shard_map some axes "
        f"are Manual: JAX refuses that, under `nnx.shard_map` too. flax's `nnx.Embed(...)("
        f"ids, out_sharding=...)` is such a call: look the rows up with "
        f"`embed.embedding[...].at[ids].get(out_sharding=...)` instead, or call it without "
        f"`out_sharding=`, or run the step under `ml.jit`."
    )


def axis_types_note(mesh: Any, message: str) -> str | None:
    """How to make the mesh, if JAX refused code that shards in types (`out_sharding=`) on
    a mesh with Auto axes (`ml.make_mesh`'s default; `jax.make_mesh` makes Explicit ones)."""
    if mesh is None or ("of type Auto" not in message and "AxisType.Auto" not in message):
        return None
    if not any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return None
    shape = dict(mesh.shape)
    return (
        f"meshlift: the mesh {shape} has Auto axes, `ml.make_mesh`'s default (`jax.make_mesh` "
        f"makes Explicit ones). Code that shards in types (`out_sharding=`, "
        f"`jax.sharding.reshard`) needs Explicit axes: make the mesh with "
        f"`ml.make_mesh({shape}, axis_types=(AxisType.Explicit,) * {len(shape)})` "
        f"(`from jax.sharding import AxisType`)."
    )


def _plan_problem(layout: Any, call: Any, check_output: bool) -> PlanError | None:
    """The first problem of the plan with this call's Variables, arguments and (if
    `check_output`) output, as a PlanError; None if none is found."""
    names, mesh = layout.names, layout.mesh
    try:
        values = layout.split.gather()
        for i, (value, sharding) in enumerate(zip(values, layout.var_shardings, strict=True)):
            path = format_path(layout.variable_path(i))
            resolve.to_sharding(sharding, mesh, path, value, names.in_specs)
        if call is None:
            return None
        for pos, sharding in layout.dyn_shardings.items():
            path = format_path(layout.leaf_paths[pos])
            resolve.to_sharding(sharding, mesh, path, call.leaves[pos], names.in_specs)
        if check_output:
            abstract_out, info = abstract_outputs(layout.pure, layout, call)
            resolve.output_shardings(
                layout.out_specs, abstract_out, info.outputs, mesh, names.out_specs
            )
    except PlanError as problem:
        return problem
    except Exception:  # the check itself failed (an abstract trace, say): JAX's error stands
        return None
    return None


def names_note(layout: Any, message: str) -> str | None:
    """A note saying whose are the staged outputs `message` names, if any (JAX names the
    inputs itself, as the caller does: see `meshlift.compat.debug_info`)."""
    said = []
    for name in _OUTPUT_NAMES:
        for i in range(len(layout.split.paths)):
            if f"{name}[0][{i}]" in message:
                path = format_path(layout.variable_path(i))
                said.append(f"{name}[0][{i}] is the Variable `{path}` (written back)")
        if f"{name}[2]" in message:
            said.append(
                f"{name}[2] is the output of {layout.names.function} ({name}[2]['b'] is "
                f"your {name}['b'])"
            )
    if not said:
        return None
    shown = "; ".join(said[:_NAMES_SHOWN])
    more = f"; and {len(said) - _NAMES_SHOWN} more" if len(said) > _NAMES_SHOWN else ""
    return (
        f"meshlift: {layout.names.function} was staged to return (its Variables, new "
        f"Variables, its output): {shown}{more}."
    )
