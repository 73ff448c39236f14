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

import difflib
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

CAPABILITIES: Mapping[str, str] = MappingProxyType(
    {
        "auto-partitioning": "the function is written for whole arrays and the compiler "
        "inserts the collectives (jax.jit)",
        "manual-collectives": "the function runs once per shard and writes its collectives "
        "out (jax.shard_map)",
        "partial-manual": "manual over some mesh axes, automatic over the others "
        "(shard_map's axis_names)",
        "vma-gradients": "with manual-collectives: the gradient of a value replicated over "
        "an axis is summed over it, as under shard_map's check_vma=True; without it the "
        "function averages its own gradients (pmap-era code: jax.lax.pmean(grads, axis))",
        "global-rng": "random draws inside the function equal those of an unsharded run",
        "stages": "the staged callable has trace and lower, and Lowered.compile() gives an "
        "object called like the function",
        "donation": "donate_argnums reuses the donated buffers",
        "multi-process": "runs on a mesh spanning jax.distributed processes",
        "call-site-mesh": "takes the mesh in context at each call (old pjit's `with mesh:`)",
        "passes-through-none": "an argument leaf that is no array and whose spec is None "
        "reaches the function unchanged (a Python int stays an int), compiled per value like "
        "a static argument, as jax.shard_map passes it; otherwise JAX traces it as an array",
        "reshards-arguments": "an argument array committed to another sharding than its "
        "spec is moved onto it for the call, as jax.shard_map does; otherwise it is refused, "
        "named, as jax.jit refuses it",
    }
)
"""The capabilities a backend can claim, each with what it promises. The conformance
kit and the integration suite read them to pick the cases a backend must pass."""


def _capabilities(values: Iterable[str]) -> frozenset[str]:
    if isinstance(values, str):
        raise TypeError(
            f"capabilities is a set of names, got the string {values!r}: write {{{values!r}}}"
        )
    return frozenset(values)


def _known(backend: Backend, attribute: Any, capabilities: frozenset[str]) -> None:
    """Refuse a capability meshlift does not know, naming the backend and the close match."""
    for name in sorted(capabilities - CAPABILITIES.keys()):
        close = difflib.get_close_matches(name, CAPABILITIES, n=1)
        raise ValueError(
            f"Backend {backend.name!r} claims the capability {name!r}, which meshlift does "
            f"not know"
            + (f"; did you mean {close[0]!r}?" if close else ".")
            + f" The capabilities are: {', '.join(CAPABILITIES)} "
            f"(meshlift.backend.CAPABILITIES says what each promises)."
        )


@attrs.frozen(kw_only=True)
class StageSpec:
    """Everything a backend needs to stage a pure function.

    `in_specs` has one entry per argument of the pure function (four tuples:
    Variables' arrays and other leaves kept, then those donated), each a tuple
    with one `jax.sharding.NamedSharding` per array, or `None` where nothing
    was specified. `out_specs` is a pytree prefix of the function's four
    outputs in the same terms. `mesh` is the call's mesh (an `AbstractMesh`
    where the user gave one) or `None`; bare `PartitionSpec`s are placed on it,
    and a `NamedSharding` the user gave keeps its own.

    Made by the core with keyword arguments, one per attribute.

    Attributes:
        in_specs: One tuple of shardings (or None) per argument of the pure function.
        out_specs: Shardings of the pure function's four outputs, a pytree prefix.
        mesh: The call's mesh; None when there is none.
        donate_argnums: Positions of the pure function's donated arguments; default none.
        options: The backend options, as its `read_options` gave them.
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

    Attributes:
        in_specs: Specs of the positional arguments, used on a mesh; default None.
        out_specs: Specs of the output, used on a mesh; default None.
        names: The front end's names for the two; default `("in_specs", "out_specs")`.
        meshless: `(in_specs, out_specs)` for a call with no mesh; default None: the
            same specs.

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
        """`(in_specs, out_specs)` for a call on `mesh` (None: no mesh in context).

        Args:
            mesh: The call's mesh, or None.

        Returns:
            `meshless` when there is no mesh and it is given, else `(in_specs, out_specs)`.
        """
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


def shard_map_specs(shardings: Any, axes: Iterable[str] | None = None) -> Any:
    """The core's leaf shardings (`StageSpec.in_specs`/`out_specs`) as `jax.shard_map`
    specs: each `NamedSharding`'s `PartitionSpec`, restricted to the manual `axes` if
    given, and `P()` (replicated) where the core left a leaf unspecified (`None`).

    What a backend that runs the function per device (`manual-collectives`) passes
    to `jax.shard_map`, while `jax.jit` gets the shardings themselves.

    Example:

    ```python
    from jax.sharding import NamedSharding

    mesh = ml.make_mesh({"data": 2, "model": 4})
    leaves = (NamedSharding(mesh, P("data", "model")), None)
    assert ml.backend.shard_map_specs(leaves) == (P("data", "model"), P())
    assert ml.backend.shard_map_specs(leaves, axes={"data"}) == (P("data", None), P())
    ```
    """
    import jax  # here, not at the top: `meshlift backends` lists plugins without jax
    from jax.sharding import NamedSharding, PartitionSpec, Sharding

    manual = None if axes is None else frozenset(axes)

    def within(entry: Any) -> Any:  # an entry (an axis, axes or None) over `manual` only
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            return None
        if manual is None:
            return entry
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def local(sharding: Any) -> PartitionSpec:
        if sharding is None:
            return PartitionSpec()
        spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"shard_map takes PartitionSpecs or NamedShardings, got "
                f"{type(sharding).__name__}: {sharding!r}; write the spec as a PartitionSpec"
            )
        return PartitionSpec(*map(within, spec))

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, PartitionSpec | Sharding)

    return jax.tree.map(local, shardings, is_leaf=is_leaf)


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

    `capabilities` name what the backend does and promises, from
    `CAPABILITIES`, one vocabulary: the core reads them (how a call's
    arguments reach the function: `manual-collectives`,
    `passes-through-none`, `reshards-arguments`), and the conformance kit
    and the integration suite read them to pick the cases it must pass; an
    unknown name is a ValueError.

    Made with keyword arguments, one per attribute; only `name` and `stage`
    are required.

    Attributes:
        name: The name `ml.transform` and `ml.get_backend` take.
        stage: `stage(fn, spec)` returning the staged callable (what `jax.jit` returns).
        frontend: The user-facing wrapper; default None: used through `ml.transform`.
        read_specs: Reads `in_specs`, `out_specs` and the options into a `Specs`;
            default: as given.
        read_mesh: Reads `mesh=` into a mesh, or a function giving one at each call;
            default: as given.
        read_options: Reads the options into `StageSpec.options`; default: all, as given.
        version: Shown in messages; default `"0"`, a plugin's: its distribution's.
        distribution: The distribution it comes from; default None: registered in this
            process (a plugin's: its entry point's distribution).
        capabilities: Names from `CAPABILITIES` that it promises; default: none.
        description: One line, shown by `ml.backends()` and `meshlift backends`.

    Raises:
        TypeError: If `capabilities` is a string.
        ValueError: If `capabilities` names one meshlift does not know.
    """

    name: str
    stage: Callable[[Callable[..., Any], StageSpec], Any]
    frontend: Callable[..., Any] | None = None
    read_specs: Callable[[Any, Any, Mapping[str, Any]], Specs] = given_specs
    read_mesh: Callable[[Any], Any] = given_mesh
    read_options: Callable[[Mapping[str, Any]], dict[str, Any]] = given_options
    version: str = "0"
    distribution: str | None = None
    capabilities: frozenset[str] = attrs.field(
        default=frozenset(), converter=_capabilities, validator=_known
    )
    description: str = ""

    @property
    def origin(self) -> str:
        """Where it comes from, as errors say it: `meshlift-jit 0.1.0`, or
        `registered in this process`."""
        return origin(self.distribution, self.version)


def origin(distribution: str | None, version: str | None) -> str:
    """A backend's or plugin's distribution and version as messages say them:
    `meshlift-jit 0.1.0`, or `registered in this process` without a distribution."""
    if distribution is None:
        return "registered in this process"
    return f"{distribution} {version}"
