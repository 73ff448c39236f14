"""Staging a pure function with `jax.shard_map` under `jax.jit`.

The core hands over leaf-level shardings (`NamedSharding` or `None`). Two
things are built from them:

* `jax.shard_map`'s specs: each sharding's `PartitionSpec` restricted to
  the manual axes, and `P()` (replicated) where the core left a leaf
  unspecified, for Variables, data and outputs alike. A written-back Variable
  gets the spec it came in with, so its shards land where they were.
* `jax.jit`'s shardings: the core's, unchanged. They place inputs the way
  the plan says, including along axes left to the compiler (`axis_names`
  smaller than the mesh).

Example:

```py
staged = stage(pure_fn, spec)         # spec: a meshlift.StageSpec
var_out, user_out, aux = staged(*inputs)
```
"""

from __future__ import annotations

import functools
import re
import traceback
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

import meshlift as ml
from meshlift_shard_map.options import manual_axes, normalize


class AxisNameError(NameError):
    """A collective inside the mapped function names an axis it is not manual over.

    A `NameError`, as JAX raises for an unbound axis name; the message names the
    manual axes and the mesh's.
    """


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit(jax.shard_map(fn, ...))` with specs from the core's leaf shardings.

    Args:
        fn: The pure function the core built.
        spec: Its shardings, mesh, donated arguments and `shard_map` options.

    Returns:
        The jitted map; with `jit=False`, an object running the map eagerly that
            still has `trace`, `lower` and `eval_shape`.

    Raises:
        TypeError: If an option is unknown, or old and new names are mixed.
        ValueError: If there is no device mesh, `axis_names` names an axis the mesh
            lacks, or `jit=False` comes with donation.
    """
    options = normalize(spec.options)
    mesh = _mesh_of(spec)
    manual = manual_axes(options, mesh.axis_names)
    mapped = _explain_varying_outputs(
        jax.shard_map(
            _name_axis_errors(fn, manual, mesh),
            mesh=mesh,
            in_specs=ml.backend.shard_map_specs(spec.in_specs, manual),
            out_specs=ml.backend.shard_map_specs(spec.out_specs, manual),
            axis_names=manual,
            check_vma=options["check_vma"],
        )
    )
    jitted = jax.jit(
        mapped,
        in_shardings=spec.in_specs,
        out_shardings=spec.out_specs,
        donate_argnums=spec.donate_argnums,
    )
    if options["jit"]:
        return jitted
    if spec.donate_argnums:
        raise ValueError(
            "donation needs the enclosing jit: drop donate_argnums/donate_argnames, or "
            "leave jit=True"
        )
    return _Eager(mapped, jitted)


class _Eager:
    """`jit=False`: calls run `jax.shard_map` eagerly (retracing each time); stages use jit."""

    def __init__(self, mapped: Callable[..., Any], jitted: Any):
        self._mapped, self._jitted = mapped, jitted

    def __call__(self, *args: Any) -> Any:
        return self._mapped(*args)

    def trace(self, *args: Any) -> Any:
        return self._jitted.trace(*args)

    def lower(self, *args: Any) -> Any:
        return self._jitted.lower(*args)

    def eval_shape(self, *args: Any) -> Any:
        return self._jitted.eval_shape(*args)


def _mesh_of(spec: ml.StageSpec) -> Mesh:
    if isinstance(spec.mesh, Mesh):
        return spec.mesh
    named = [s for s in jax.tree.leaves(spec.in_specs) if isinstance(s, NamedSharding)]
    if spec.mesh is None and named and isinstance(named[0].mesh, Mesh):
        return named[0].mesh
    raise ValueError(
        f"shard_map needs a concrete device mesh, got {spec.mesh!r}: pass mesh=, or call "
        f"the function inside `with ml.use_mesh(mesh):`"
    )


def _explain_varying_outputs(mapped: Callable[..., Any]) -> Callable[..., Any]:
    """`mapped`, with the fix added to JAX's error for an output its out_specs call
    replicated but that varies over a manual axis (the core names the output or Variable)."""

    @functools.wraps(mapped)
    def checked(*args: Any) -> Any:
        try:
            return mapped(*args)
        except ValueError as e:
            if "can't be statically inferred" in str(e):
                e.add_note(
                    "To fix it, reduce each value named above over the axes it varies "
                    "over before returning it: `jax.lax.pmean(value, 'data')` (a loss, or "
                    "a statistic such as BatchNorm's mean updated on each device's batch), "
                    "or `jax.lax.psum`; or give it an out_specs entry over those axes."
                )
            raise

    return checked


_UNBOUND = re.compile(r"unbound axis name: (\w+)")
_COLLECTIVES = PurePath("jax", "_src", "lax", "parallel.py").parts


def _name_axis_errors(fn: Callable[..., Any], manual: frozenset[str], mesh: Mesh) -> Callable:
    """`fn`, with JAX's trace-time error for a collective over a non-manual axis explained."""

    @functools.wraps(fn)
    def body(*args: Any) -> Any:
        try:
            return fn(*args)
        except NameError as e:
            found = _UNBOUND.search(str(e))
            if found is None:
                raise
            raise AxisNameError(_axis_message(repr(found[1]), manual, mesh)) from e
        except AssertionError as e:  # jax asserts inside pvary for an axis the mesh lacks
            frames = traceback.extract_tb(e.__traceback__)
            if not any(PurePath(f.filename).parts[-4:] == _COLLECTIVES for f in frames):
                raise
            raise AxisNameError(_axis_message("an axis", manual, mesh)) from e

    return body


def _axis_message(axis: str, manual: frozenset[str], mesh: Mesh) -> str:
    return (
        f"a collective (psum, pmean, all_gather, axis_index...) inside the shard_mapped "
        f"function names {axis}, which is not one of its manual axes "
        f"{sorted(manual)} (axis_names) on mesh {dict(mesh.shape)}. Use an axis in "
        f"axis_names, add the axis to axis_names (or drop it from auto=), or use a mesh "
        f"that has it. The argument it applies to is not known at this point: look for the "
        f"collective in the traceback above."
    )
