"""Old `jax.experimental.pjit` code on today's `jax.jit`: `ml.pjit` and `ml.transform("pjit", ...)`.

Specs are given as `in_axis_resources`/`out_axis_resources` (or the later
`in_shardings`/`out_shardings`), `None` means replicated, and the mesh
is the one in context at each call. Each mesh gets its own compiled program.

Example:

```python
import jax.numpy as jnp
import meshlift as ml
from jax.sharding import PartitionSpec as P

f = ml.pjit(lambda x: x * 2, in_axis_resources=P("data"), out_axis_resources=None)
x = jnp.arange(8.0)                 # made outside the mesh context: not yet placed
with ml.use_mesh(ml.make_mesh({"data": 2, "model": 4})):
    y = f(x)                        # replicated on the 2x4 mesh
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ParamSpec, TypeVar

import jax
from jax.sharding import Mesh

import meshlift as ml
from meshlift import compat
from meshlift_pjit.context import call_site_mesh
from meshlift_pjit.specs import UNSPECIFIED, legacy_specs, meshless_specs, pick

try:
    __version__ = version("meshlift-pjit")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = [
    "BACKEND",
    "UNSPECIFIED",
    "call_site_mesh",
    "pjit",
    "read_mesh",
    "read_options",
    "read_specs",
    "stage",
]

_IN_NAMES = ("in_axis_resources", "in_shardings")
_OUT_NAMES = ("out_axis_resources", "out_shardings")

Params = ParamSpec("Params")
Result = TypeVar("Result")


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit` over the pure function, with shardings resolved on the call-site mesh.

    Args:
        fn: The pure function the core built.
        spec: Its shardings, mesh, donated arguments and `jax.jit` options.

    Returns:
        The `jax.jit`-wrapped function; on a concrete mesh, wrapped to run under it.
    """
    jitted = jax.jit(
        fn,
        in_shardings=spec.in_specs,
        out_shardings=spec.out_specs,
        donate_argnums=spec.donate_argnums,
        **spec.options,
    )
    return OnMesh(jitted, spec.mesh) if isinstance(spec.mesh, Mesh) else jitted


class OnMesh:
    """A jitted function run on a mesh's devices, as old `pjit` ran under `with mesh:`.

    `jax.jit` places a computation on the mesh of `jax.set_mesh` only; under
    the deprecated `with mesh:` context (or `mesh=`) it is entered around
    each call, outside traces, so unspecified arrays land on the mesh.
    """

    def __init__(self, jitted: Any, mesh: Any):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args: Any) -> Any:
        return self._on_mesh("__call__", args)

    def trace(self, *args: Any) -> Any:
        return self._on_mesh("trace", args)

    def lower(self, *args: Any) -> Any:
        return self._on_mesh("lower", args)

    def eval_shape(self, *args: Any) -> Any:
        return self._on_mesh("eval_shape", args)

    def _on_mesh(self, method: str, args: tuple[Any, ...]) -> Any:
        run = getattr(self.jitted, method)
        if ml.current_mesh() is not None or not compat.outside_traces():
            return run(*args)
        with jax.set_mesh(self.mesh):
            return run(*args)


def read_specs(in_specs: Any, out_specs: Any, options: Mapping[str, Any]) -> ml.Specs:
    """The specs as old `pjit` reads them, under any of their names.

    `in_axis_resources`/`out_axis_resources` (or the later `in_shardings`/
    `out_shardings`, among the options) stand for `in_specs`/`out_specs`;
    `None` inside a spec tree means replicated on the mesh (the compiler's
    choice with no mesh). `in_specs=None` from `ml.transform` is "not given".

    Args:
        in_specs: `ml.transform`'s `in_specs`; None: not given.
        out_specs: `ml.transform`'s `out_specs`; None: not given.
        options: The options, where `pjit`'s own spec arguments arrive.

    Returns:
        `Specs` named as they were given, with a reading for calls with no mesh.

    Raises:
        ValueError: If the same specs are given under two names.
    """
    read = [
        pick(
            {**{n: options.get(n, UNSPECIFIED) for n in old_names}, unified: _given(specs)},
            default=old_names[0],
        )
        for specs, unified, old_names in (
            (in_specs, "in_specs", _IN_NAMES),
            (out_specs, "out_specs", _OUT_NAMES),
        )
    ]
    (in_name, in_given), (out_name, out_given) = read
    return ml.Specs(
        legacy_specs(in_given, arguments=True),
        legacy_specs(out_given),
        names=(in_name, out_name),
        meshless=(meshless_specs(in_given, arguments=True), meshless_specs(out_given)),
    )


def _given(specs: Any) -> Any:
    """`ml.transform`'s `None`: no specs given."""
    return UNSPECIFIED if specs is None else specs


def read_mesh(mesh: Any) -> Any:
    """The given mesh, or else the one in context at each call (`call_site_mesh`).

    Args:
        mesh: The mesh given to `ml.transform`, or None.

    Returns:
        `mesh`, or `call_site_mesh` if it is None.
    """
    return call_site_mesh if mesh is None else mesh


def read_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`jax.jit`'s options: every one but the spec arguments `read_specs` took.

    Args:
        options: The options given to `ml.transform`.

    Returns:
        A new dict without `in_axis_resources`, `out_axis_resources`, `in_shardings`
            and `out_shardings`.
    """
    return {k: v for k, v in options.items() if k not in _IN_NAMES + _OUT_NAMES}


@ml.takes_lift_options
def pjit(
    fun: Callable[Params, Result],
    in_axis_resources: Any = UNSPECIFIED,
    out_axis_resources: Any = UNSPECIFIED,
    static_argnums: int | Iterable[int] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    *,
    in_shardings: Any = UNSPECIFIED,
    out_shardings: Any = UNSPECIFIED,
    keep_unused: bool = False,
    **lift: Any,
) -> ml.Lifted[Params, Result]:
    """Old `pjit` over modules, plans and pytrees, with the mesh taken at each call.

    Spec trees are pytree prefixes of the positional arguments and the output,
    with `PartitionSpec`, `NamedSharding`, `StateSharding` or `None`
    (replicated) leaves; lists are read as tuples. `in_shardings` and
    `out_shardings` are the later names of the same arguments. As in old
    `pjit` and `jax.jit`, keyword arguments are refused when specs are
    given, unless static. `keep_unused` is `jax.jit`'s. `static_argnums` and
    `donate_argnums` are old `pjit`'s positional parameters; the other lift
    options (`ml.LiftOptions`) are keywords.

    Args:
        fun: The function to lift.
        in_axis_resources: Specs of the positional arguments; not given: unspecified.
        out_axis_resources: Specs of the output; not given: unspecified.
        static_argnums: Positions of static arguments, as in `jax.jit`.
        donate_argnums: Positions of donated arguments, as in `jax.jit`.
        in_shardings: The later name of `in_axis_resources`; give one of the two.
        out_shardings: The later name of `out_axis_resources`; give one of the two.
        keep_unused: `jax.jit`'s.
        **lift: The other lift options, `ml.LiftOptions`: `static_argnames` and
            `donate_argnames` as in `jax.jit`, `graph` and `graph_updates` as in `nnx.jit`.

    Returns:
        The `Lifted` function; its mesh is the one in context at each call.

    Raises:
        ValueError: If specs are given under both names, or the static or donated
            arguments do not fit `fun`; at a call, for keyword arguments next to specs.
        meshlift.PlanError: If a module stands where specs go; at a call, if a spec
            does not fit its argument or needs a mesh and there is none.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    params, batch = {"w": jnp.ones((16, 32))}, jnp.ones((8, 16))
    plan = {"w": P(None, "model")}

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    step = ml.pjit(train_step, in_axis_resources=(plan, P("data")),
                   out_axis_resources=(plan, None))
    with ml.use_mesh(mesh):
        params, loss = step(params, batch)
    ```
    """
    return ml.transform(
        BACKEND,
        fun,
        in_axis_resources=in_axis_resources,
        out_axis_resources=out_axis_resources,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        donate_argnums=donate_argnums,
        keep_unused=keep_unused,
        **lift,
    )


BACKEND = ml.Backend(
    name="pjit",
    stage=stage,
    frontend=pjit,
    read_specs=read_specs,
    read_mesh=read_mesh,
    read_options=read_options,
    version=__version__,
    distribution="meshlift-pjit",
    capabilities={"auto-partitioning", "global-rng", "stages", "donation", "call-site-mesh"},
    description="old pjit semantics (in_axis_resources, call-site mesh) on jax.jit, per mesh",
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
