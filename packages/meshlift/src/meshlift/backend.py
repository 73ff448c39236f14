"""The backend object: what a plugin hands to meshlift.

A backend maps meshlift's unified arguments onto one JAX transform. The core
does all graph work and spec resolution; a backend only sees a pure function
over pytrees of arrays and leaf-level specs, and returns JAX's staged callable
(something with `__call__`, `lower`, `trace` and `eval_shape`, such as
the result of `jax.jit`).

Example:

```python
import jax
import meshlift as ml

def stage(fn, spec: ml.StageSpec):
    return jax.jit(fn, in_shardings=spec.in_specs,
                   out_shardings=spec.out_specs,
                   donate_argnums=spec.donate_argnums)

backend = ml.Backend(name="my-jit", stage=stage)
f = ml.transform(backend, lambda x: x * 2)
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs


def _names(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


@attrs.frozen(kw_only=True)
class StageSpec:
    """Everything a backend needs to stage a pure function.

    `in_specs` has one entry per positional argument of the pure function,
    each a pytree prefix of that argument whose leaves are
    `jax.sharding.NamedSharding`, `PartitionSpec` or `None`
    (unspecified). `out_specs` is a pytree prefix of the output in the same
    terms. Bare `PartitionSpec` leaves only appear when `mesh` is set.
    """

    in_specs: tuple[Any, ...]
    out_specs: Any
    mesh: Any = None
    donate_argnums: tuple[int, ...] = ()
    options: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class Backend:
    """A transform backend, registered by a plugin or passed as an object.

    `stage(fn, spec)` returns the JAX-level staged callable for the pure
    function `fn`. `frontend`, if given, is the user-facing wrapper with
    the transform's own argument names (`ml.jit` for the jit backend).
    `unify`, if given, rewrites the keyword arguments `ml.transform` was
    called with (`mesh`, `in_specs`, `out_specs`, `options`...) into
    those `ml.Lifted` takes: where a backend reads old argument names, gives
    `None` another meaning, or looks the mesh up its own way.
    `capabilities` are free-form strings the integration suite reads to
    decide which cases a backend declares it cannot run. `spec_names` are
    the front end's names for `in_specs`/`out_specs`, used in errors.
    With `passes_through_none`, an argument leaf that is not an array and
    whose spec is `None` reaches the function unchanged (a Python `int`
    stays an `int`), compiled per value like a static argument, as
    `jax.shard_map` passes it.
    """

    name: str
    stage: Callable[[Callable[..., Any], StageSpec], Any]
    frontend: Callable[..., Any] | None = None
    unify: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    version: str = "0"
    distribution: str | None = None
    capabilities: frozenset[str] = attrs.field(default=frozenset(), converter=_names)
    description: str = ""
    spec_names: tuple[str, str] = ("in_specs", "out_specs")
    passes_through_none: bool = False
