"""JAX's errors about a staged function, told in the caller's names.

JAX names the staged function's inputs (`kept_dyn[0]`) and output specs
(`out_specs[0][3]`), and says "does not evenly divide" without saying
whose shape. `named_errors` puts the caller's paths into those errors
(`model.kernel`, `batch`), or raises a `PlanError` naming the argument
whose spec does not fit, and otherwise lets JAX's error stand.

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
import re
from collections.abc import Iterator
from typing import Any

from meshlift import resolve
from meshlift.paths import PlanError, format_path
from meshlift.pure import abstract_outputs

# the staged function's four inputs, as JAX's messages name them
_INPUT_GROUPS = {"kept_vars": 0, "kept_dyn": 1, "donated_vars": 2, "donated_dyn": 3}
_STAGED_INPUT = re.compile(r"\b(kept_vars|kept_dyn|donated_vars|donated_dyn)\[(\d+)\]")
_STAGED_OUTPUT = re.compile(r"\b(out_specs|out_shardings)((?:\[\d+\])+)")


@contextlib.contextmanager
def named_errors(layout: Any, call: Any = None) -> Iterator[None]:
    """Errors raised inside, told in `layout`'s caller names (see the module)."""
    try:
        yield
    except Exception as error:
        rename_staged(layout, error)
        name_indivisible(layout, error, call)
        raise


def name_indivisible(layout: Any, error: BaseException, call: Any) -> None:
    """JAX found a sharding that does not divide a shape, without saying whose: raise a
    PlanError naming the argument or output (a Variable whose shape changed since its
    plan was resolved, an output spec that does not fit). Without this call's leaves
    (`call` None) only the Variables are looked at."""
    if not isinstance(error, ValueError) or "evenly divide" not in str(error):
        return
    names, mesh = layout.names, layout.mesh
    try:
        values = layout.split.gather()
        for i, (value, sharding) in enumerate(zip(values, layout.var_shardings, strict=True)):
            path = format_path(layout.variable_path(i))
            resolve.to_sharding(sharding, mesh, path, value, names.in_specs)
        if call is None:
            return
        for pos, sharding in layout.dyn_shardings.items():
            path = format_path(layout.leaf_paths[pos])
            resolve.to_sharding(sharding, mesh, path, call.leaves[pos], names.in_specs)
        abstract_out, info = abstract_outputs(layout.pure, layout, call)
        resolve.output_shardings(
            layout.out_specs, abstract_out, info.outputs, mesh, names.out_specs
        )
    except PlanError as named:
        raise named from error
    except Exception:  # the explanation failed: JAX's own error stands
        return


def rename_staged(layout: Any, error: BaseException) -> None:
    """Put the caller's names in a JAX error that names the staged function's inputs
    (`kept_dyn[0]`) or output specs (`out_specs[0][3]`)."""
    if len(error.args) != 1 or not isinstance(error.args[0], str):
        return
    text = _STAGED_INPUT.sub(lambda match: _input_name(layout, match), error.args[0])
    text = _STAGED_OUTPUT.sub(lambda match: _output_name(layout, match), text)
    text = text.replace("the function <unknown>", f"the function {layout.names.function}")
    error.args = (text,)


def _input_name(layout: Any, match: re.Match[str]) -> str:
    group, j = _INPUT_GROUPS[match.group(1)], int(match.group(2))
    positions = (layout.var_groups, layout.dyn_groups)[group % 2][group // 2]
    if j >= len(positions):
        return match.group(0)
    if group % 2 == 0:
        return f"`{format_path(layout.variable_path(positions[j]))}`"
    return f"`{format_path(layout.leaf_paths[positions[j]])}`"


def _output_name(layout: Any, match: re.Match[str]) -> str:
    """`[0][i]`: the Variable at split position i; `[2]...`: the caller's output."""
    where, *rest = (int(i) for i in re.findall(r"\d+", match.group(2)))
    if where == 0 and len(rest) == 1 and rest[0] < len(layout.split.paths):
        return f"the Variable `{format_path(layout.variable_path(rest[0]))}` (written back)"
    if where == 2:
        return f"{layout.names.out_specs} for `{format_path(('output', *map(str, rest)))}`"
    return match.group(0)
