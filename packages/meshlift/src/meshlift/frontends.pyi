# The front ends' signatures, as type checkers see `ml.jit`, `ml.shard_map`, `ml.pjit` and
# `ml.pipeline`.
#
# At run time each forwards to its backend's front end (meshlift_jit.jit,
# meshlift_shard_map.shard_map, meshlift_pjit.pjit, meshlift_pipeline.pipeline), found through the plugins: the core
# imports no plugin, not even for types. tests/test_frontends_stub.py checks that these
# signatures are the plugins' own. The lift options (static_argnums ... graph_updates) are
# written here as each front end's signature shows them: `ml.LiftOptions` defines them once.

from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar, overload

import jax
from jax.sharding import AbstractMesh, Mesh

from meshlift.call.lift import Lifted

Params = ParamSpec("Params")
Result = TypeVar("Result")

@overload
def jit(
    fun: Callable[Params, Result],
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
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Lifted[Params, Result]: ...
@overload
def jit(
    fun: None = None,
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
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable[[Callable[Params, Result]], Lifted[Params, Result]]: ...
@overload
def shard_map(
    f: Callable[Params, Result],
    /,
    *,
    in_specs: Any,
    out_specs: Any,
    mesh: Mesh | AbstractMesh | None = None,
    axis_names: Iterable[str] = ...,
    check_vma: bool = True,
    jit: bool = True,
    check_rep: bool | None = None,
    auto: Iterable[str] | None = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Lifted[Params, Result]: ...
@overload
def shard_map(
    f: None = None,
    /,
    *,
    in_specs: Any,
    out_specs: Any,
    mesh: Mesh | AbstractMesh | None = None,
    axis_names: Iterable[str] = ...,
    check_vma: bool = True,
    jit: bool = True,
    check_rep: bool | None = None,
    auto: Iterable[str] | None = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable[[Callable[Params, Result]], Lifted[Params, Result]]: ...
def pjit(
    fun: Callable[Params, Result],
    in_axis_resources: Any = ...,
    out_axis_resources: Any = ...,
    static_argnums: int | Iterable[int] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    *,
    in_shardings: Any = ...,
    out_shardings: Any = ...,
    keep_unused: bool = False,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Lifted[Params, Result]: ...
@overload
def pipeline(
    fun: Callable[Params, Result],
    /,
    *,
    microbatches: int | None = None,
    repeats: int = 1,
    stage_axis: str = "stage",
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    compiler_options: dict[str, Any] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Lifted[Params, Result]: ...
@overload
def pipeline(
    fun: None = None,
    /,
    *,
    microbatches: int | None = None,
    repeats: int = 1,
    stage_axis: str = "stage",
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    compiler_options: dict[str, Any] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable[[Callable[Params, Result]], Lifted[Params, Result]]: ...
