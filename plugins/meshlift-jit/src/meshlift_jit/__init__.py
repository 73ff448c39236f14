"""The `jax.jit` backend for meshlift: `ml.jit` and `ml.transform("jit", ...)`.

Example:

```python
import meshlift as ml
from jax.sharding import PartitionSpec as P

mesh = ml.make_mesh({"data": 2, "model": 4})
plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})

@ml.jit(in_shardings=(plan, P("data")), out_shardings=P(), mesh=mesh)
def train_step(model, batch):
    ...
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import jax

import meshlift as ml

try:
    __version__ = version("meshlift-jit")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit` over the pure function, with the core's leaf-level shardings.

    Args:
        fn: The pure function the core built.
        spec: Its shardings, donated arguments and `jax.jit` options.

    Returns:
        The `jax.jit`-wrapped function.

    Raises:
        ValueError: If `device=` or `backend=` is given next to shardings.
    """
    shardings = {"in_shardings": spec.in_specs, "out_shardings": spec.out_specs}
    if "device" in spec.options or "backend" in spec.options:
        if any(s is not None for s in jax.tree.leaves(shardings)):
            raise ValueError(
                "jit's device= and backend= cannot be combined with shardings: drop them and "
                "place the computation with mesh= and in_shardings instead"
            )
        shardings = {}  # jax.jit refuses shardings next to device/backend
    return jax.jit(fn, donate_argnums=spec.donate_argnums, **shardings, **spec.options)


@ml.takes_lift_options
def jit(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    device: jax.Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    **lift: Any,
) -> Any:
    """`jax.jit` over functions of NNX modules, optimizers and arrays, with write-back.

    Takes every `jax.jit` option. Shardings are pytree prefixes of the
    positional arguments and the output whose leaves may also be
    `StateSharding` plans; bare `PartitionSpec` leaves resolve against
    `mesh` or the mesh of `ml.use_mesh`. Updates to Variables inside the
    function land on the caller's objects. `graph`/`graph_updates` are
    `nnx.jit`'s: True is what meshlift does anyway, False (tree mode) is refused.

    Args:
        fun: The function to lift; None gives a decorator.
        in_shardings: Shardings of the positional arguments (a pytree prefix); None:
            unspecified.
        out_shardings: Shardings of the output (a pytree prefix); None: unspecified.
        keep_unused: `jax.jit`'s.
        device: `jax.jit`'s; refused next to shardings.
        backend: `jax.jit`'s; refused next to shardings.
        inline: `jax.jit`'s.
        compiler_options: `jax.jit`'s.
        mesh: The mesh bare `PartitionSpec`s resolve against; None: the one of
            `ml.use_mesh` at each call.
        **lift: The lift options, `ml.LiftOptions`: `static_argnums`, `static_argnames`,
            `donate_argnums`, `donate_argnames` as in `jax.jit`; `graph`,
            `graph_updates` as in `nnx.jit` (True or None; False is refused).

    Returns:
        The `Lifted` function, or, with `fun=None`, a decorator making one.

    Raises:
        TypeError: As `ml.transform` (a non-callable `fun`, a `mesh` that is no mesh).
        ValueError: If `graph` or `graph_updates` is False, or the static or donated
            arguments do not fit `fun`; at the first call, if `device`/`backend` come
            with shardings.
        meshlift.PlanError: If a module stands where shardings go; at a call, if a
            sharding does not fit its argument.

    Example:

    ```python
    import optax

    mesh = ml.make_mesh({"data": 2, "model": 4})
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(batch) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    step = ml.jit(train_step, in_shardings=(plan, plan, P("data")), mesh=mesh)
    loss = step(model, optimizer, jnp.ones((8, 16)))   # model and optimizer updated in place
    ```
    """
    options = {
        name: value
        for name, value, default in (
            ("keep_unused", keep_unused, False),
            ("device", device, None),
            ("backend", backend, None),
            ("inline", inline, False),
            ("compiler_options", compiler_options, None),
        )
        if value != default
    }
    return ml.transform(
        BACKEND,
        fun,
        mesh=mesh,
        in_specs=in_shardings,
        out_specs=out_shardings,
        **lift,
        **options,
    )


def read_specs(in_shardings: Any, out_shardings: Any, options: Mapping[str, Any]) -> ml.Specs:
    """The specs as given, named as `jax.jit` names them in errors.

    jax's own `UNSPECIFIED` marker (what `jax.jit` passes for an omitted
    sharding) reads as None, as in `jax.jit`.

    Args:
        in_shardings: The argument shardings given to `jit`.
        out_shardings: The output shardings given to `jit`.
        options: The other options (unused).

    Returns:
        `Specs` named `in_shardings`/`out_shardings`.
    """
    return ml.Specs(
        _unspecified_as_none(in_shardings),
        _unspecified_as_none(out_shardings),
        names=("in_shardings", "out_shardings"),
    )


def _unspecified_as_none(specs: Any) -> Any:
    return jax.tree.map(
        lambda spec: None if _is_unspecified(spec) else spec,
        specs,
        is_leaf=lambda x: (
            x is None or _is_unspecified(x) or isinstance(x, jax.sharding.PartitionSpec)
        ),
    )


def _is_unspecified(spec: Any) -> bool:
    return type(spec).__name__ == "UnspecifiedValue"  # jax._src.sharding_impls.UNSPECIFIED


BACKEND = ml.Backend(
    name="jit",
    stage=stage,
    frontend=jit,
    version=__version__,
    distribution="meshlift-jit",
    capabilities={"auto-partitioning", "global-rng", "stages", "donation", "multi-process"},
    description="jax.jit with shardings from the plan; the compiler inserts collectives",
    read_specs=read_specs,
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
