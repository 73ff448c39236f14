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

from collections.abc import Callable, Iterable
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

__all__ = ["BACKEND", "UNSPECIFIED", "call_site_mesh", "pjit", "stage", "unify"]

_OLD_NAMES = (("in_axis_resources", "in_specs"), ("out_axis_resources", "out_specs"))

Params = ParamSpec("Params")
Result = TypeVar("Result")


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit` over the pure function, with shardings resolved on the call-site mesh."""
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


def unify(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`ml.transform("pjit", ...)`'s arguments read the way `ml.pjit` reads them.

    `in_axis_resources`/`out_axis_resources` are accepted for `in_specs`/
    `out_specs`, `None` inside a spec tree means replicated on the mesh
    (the compiler's choice with no mesh), and without `mesh=` the mesh is
    looked up at each call.
    """
    options = dict(kwargs["options"])
    unified = dict(kwargs)
    names, meshless = [], []
    for old, new in _OLD_NAMES:
        given_new = UNSPECIFIED if kwargs[new] is None else kwargs[new]
        name, specs = pick(old, options.pop(old, UNSPECIFIED), new, given_new)
        arguments = new == "in_specs"
        unified[new] = legacy_specs(specs, arguments=arguments)
        names.append(name)
        meshless.append(meshless_specs(specs, arguments=arguments))
    if kwargs["mesh"] is None:
        unified["mesh"] = call_site_mesh
    return {
        **unified,
        "options": options,
        "spec_names": tuple(names),
        "meshless_specs": tuple(meshless),
    }


def pjit(
    fun: Callable[Params, Result],
    in_axis_resources: Any = UNSPECIFIED,
    out_axis_resources: Any = UNSPECIFIED,
    static_argnums: int | Iterable[int] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    *,
    in_shardings: Any = UNSPECIFIED,
    out_shardings: Any = UNSPECIFIED,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    keep_unused: bool = False,
) -> ml.Lifted[Params, Result]:
    """Old `pjit` over modules, plans and pytrees, with the mesh taken at each call.

    Spec trees are pytree prefixes of the positional arguments and the output,
    with `PartitionSpec`, `NamedSharding`, `StateSharding` or `None`
    (replicated) leaves; lists are read as tuples. `in_shardings` and
    `out_shardings` are the later names of the same arguments. As in old
    `pjit` and `jax.jit`, keyword arguments are refused when specs are
    given, unless static. `keep_unused` is `jax.jit`'s.

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
    in_name, in_specs = pick("in_axis_resources", in_axis_resources, "in_shardings", in_shardings)
    out_name, out_specs = pick(
        "out_axis_resources", out_axis_resources, "out_shardings", out_shardings
    )
    options = {"keep_unused": True} if keep_unused else {}
    return ml.Lifted(
        fun,
        backend=BACKEND,
        mesh=call_site_mesh,
        in_specs=legacy_specs(in_specs, arguments=True),
        out_specs=legacy_specs(out_specs),
        meshless_specs=(meshless_specs(in_specs, arguments=True), meshless_specs(out_specs)),
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        options=options,
        spec_names=(in_name, out_name),
    )


BACKEND = ml.Backend(
    name="pjit",
    stage=stage,
    frontend=pjit,
    unify=unify,
    version=__version__,
    distribution="meshlift-pjit",
    capabilities={"auto-partitioning", "global-rng", "stages", "donation", "call-site-mesh"},
    description="old pjit semantics (in_axis_resources, call-site mesh) on jax.jit, per mesh",
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
