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


@attrs.frozen
class Specs:
    """A lifted function's specs, as its backend reads what the front end was given.

    `in_specs`/`out_specs` are used on a mesh. `meshless`, if given, is
    `(in_specs, out_specs)` for a call with no mesh in context, where a front
    end reads its specs differently (old `pjit`'s `None`: replicated on a
    mesh, else the compiler's choice). `names` are the front end's words for
    the two, used in errors.

    Example:

    ```python
    specs = ml.Specs(P("data"), None, names=("in_shardings", "out_shardings"))
    assert specs.on(mesh=None) == (P("data"), None)
    ```
    """

    in_specs: Any = None
    out_specs: Any = None
    names: tuple[str, str] = ("in_specs", "out_specs")
    meshless: tuple[Any, Any] | None = None

    def on(self, mesh: Any) -> tuple[Any, Any]:
        """`(in_specs, out_specs)` for a call on `mesh` (None: no mesh in context)."""
        if mesh is None and self.meshless is not None:
            return self.meshless
        return self.in_specs, self.out_specs


def given_specs(in_specs: Any, out_specs: Any, options: Mapping[str, Any]) -> Specs:
    """The default `Backend.read_specs`: the specs as given, named `in_specs`/`out_specs`."""
    return Specs(in_specs, out_specs)


def given_mesh(mesh: Any) -> Any:
    """The default `Backend.read_mesh`: the mesh as given."""
    return mesh


def given_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The default `Backend.read_options`: every option goes to `stage` unchanged."""
    return dict(options)


@attrs.frozen(kw_only=True)
class Backend:
    """A transform backend, registered by a plugin or passed as an object.

    `stage(fn, spec)` returns the JAX-level staged callable for the pure
    function `fn`. `frontend`, if given, is the user-facing wrapper with
    the transform's own argument names (`ml.jit` for the jit backend).

    Three readers turn what `ml.transform` was given into what the core
    uses, once per lifted function; each defaults to "as given":

    - `read_specs(in_specs, out_specs, options) -> Specs`: the specs, their
      names in errors, and another reading with no mesh; a front end's own
      spec arguments (old names) arrive among `options`.
    - `read_mesh(mesh)`: the mesh, or a function the core calls at each call
      to find it (a call-site context).
    - `read_options(options) -> dict`: the options `stage` receives, as
      `StageSpec.options` (old option names converted, spec arguments
      taken out).

    `capabilities` are free-form strings the integration suite reads to
    decide which cases a backend declares it cannot run. With
    `passes_through_none`, an argument leaf that is not an array and whose
    spec is `None` reaches the function unchanged (a Python `int` stays an
    `int`), compiled per value like a static argument, as `jax.shard_map`
    passes it.
    """

    name: str
    stage: Callable[[Callable[..., Any], StageSpec], Any]
    frontend: Callable[..., Any] | None = None
    read_specs: Callable[[Any, Any, Mapping[str, Any]], Specs] = given_specs
    read_mesh: Callable[[Any], Any] = given_mesh
    read_options: Callable[[Mapping[str, Any]], dict[str, Any]] = given_options
    version: str = "0"
    distribution: str | None = None
    capabilities: frozenset[str] = attrs.field(default=frozenset(), converter=_names)
    description: str = ""
    passes_through_none: bool = False

    @property
    def origin(self) -> str:
        """Where it comes from, as errors say it: `meshlift-jit 0.1.0`, or
        `registered in this process`."""
        if self.distribution is None:
            return "registered in this process"
        return f"{self.distribution} {self.version}"
