"""`ml.transform`: lift a function with any backend, by name or object.

Every front end (`ml.jit`, `ml.shard_map`, `ml.pjit`) renames its arguments
and comes here: one translation onto `meshlift.call.lift.Lifted`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

from meshlift.backend import Backend
from meshlift.call.lift import Lifted, MeshLike, Params, Result
from meshlift.call.options import LiftOptions, takes_lift_options
from meshlift.plugins import get_backend


@overload
def transform(
    backend: str | Backend, fun: Callable[Params, Result], /, **options: Any
) -> Lifted[Params, Result]: ...


@overload
def transform(
    backend: str | Backend, fun: None = None, /, **options: Any
) -> Callable[[Callable[Params, Result]], Lifted[Params, Result]]: ...


@takes_lift_options
def transform(
    backend: str | Backend,
    fun: Callable[..., Any] | None = None,
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    **options: Any,
) -> Any:
    """Lift `fun` with any backend, by name or object, using the unified argument names.

    `in_specs`/`out_specs` are pytree prefixes of the positional arguments
    and the output, with `PartitionSpec`, `NamedSharding`, `None` or
    `StateSharding` leaves. Other keyword options go to the backend.
    `graph` and `graph_updates` are flax's (`nnx.jit`'s) names for what
    meshlift always does (graph semantics, updates carried back): True or
    None; False, flax's tree mode, is refused rather than run otherwise.

    Args:
        backend: A backend name (`"jit"`, `"shard_map"`, `"pjit"`...) or a `Backend`.
        fun: The function to lift; None gives a decorator.
        mesh: A mesh, a function returning one at each call, or None for the mesh of
            `ml.use_mesh`.
        in_specs: Specs of the positional arguments; None: unspecified.
        out_specs: Specs of the output; None: unspecified.
        **options: The lift options (`ml.LiftOptions`: `static_argnums`,
            `donate_argnames`, `graph`...), then the backend's own (`keep_unused`,
            `check_vma`...), passed to its `stage`.

    Returns:
        The `Lifted` function, or, with `fun=None`, a decorator making one.

    Raises:
        TypeError: If `graph` or `graph_updates` is not a bool or None, or as `Lifted`.
        ValueError: If `graph` or `graph_updates` is False (flax's tree mode), or as
            `Lifted`.
        meshlift.BackendNotFoundError: If no installed backend has the name `backend`.
        meshlift.errors.PluginError: If two plugins register the name `backend`.

    Example:

    ```python
    import optax

    mesh = ml.make_mesh({"data": 2, "model": 4})
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(batch) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    step = ml.transform("jit", train_step, mesh=mesh, in_specs=(plan, plan, P("data")),
                        out_specs=P())
    loss = step(model, optimizer, jnp.ones((8, 16)))
    ```
    """
    lift_options, backend_options = LiftOptions.split(options)
    backend = get_backend(backend)
    lift = functools.partial(
        Lifted,
        backend=backend,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        lift=lift_options,
        options=backend_options,
    )
    return lift if fun is None else lift(fun)
