"""`ml.transform`: lift a function with any backend, by name or object.

Every front end (`ml.jit`, `ml.shard_map`, `ml.pjit`) renames its arguments
and comes here: one translation onto `meshlift.lift.Lifted`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, overload

from meshlift.arguments import check_graph_mode
from meshlift.backend import Backend
from meshlift.lift import Lifted, MeshLike, Params, Result
from meshlift.plugins import get_backend


@overload
def transform(
    backend: str | Backend,
    fun: Callable[Params, Result],
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    **options: Any,
) -> Lifted[Params, Result]: ...


@overload
def transform(
    backend: str | Backend,
    fun: None = None,
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    **options: Any,
) -> Callable[[Callable[Params, Result]], Lifted[Params, Result]]: ...


def transform(
    backend: str | Backend,
    fun: Callable[..., Any] | None = None,
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
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
        static_argnums: Positions of static arguments, as in `jax.jit`.
        static_argnames: Names of static arguments, as in `jax.jit`.
        donate_argnums: Positions of donated arguments, as in `jax.jit`.
        donate_argnames: Names of donated arguments, as in `jax.jit`.
        graph: flax's `graph=`: True or None; False is refused.
        graph_updates: flax's `graph_updates=`: True or None; False is refused.
        **options: Backend options (`keep_unused`, `check_vma`...), passed to its `stage`.

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
    check_graph_mode(graph=graph, graph_updates=graph_updates)
    backend = get_backend(backend)
    lift = functools.partial(
        Lifted,
        backend=backend,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        options=options,
    )
    return lift if fun is None else lift(fun)
