"""The `jax.shard_map` backend for meshlift: `ml.shard_map` and `ml.transform("shard_map", ...)`.

The function runs once per device on its shards of modules and data, with
collectives (`psum`, `pmean`, `all_gather`...) written by hand. Specs
are pytree prefixes of the arguments and outputs whose leaves are
`PartitionSpec`s or `StateSharding` plans, as for `ml.jit`.

Example:

```python
import jax, jax.numpy as jnp
import meshlift as ml
from flax import nnx
from jax.sharding import PartitionSpec as P

mesh = ml.make_mesh({"data": 2, "model": 4})
model = nnx.Linear(16, 32, use_bias=False, rngs=nnx.Rngs(0))
plan = ml.StateSharding({ml.path_endswith("kernel"): P("model", None)})  # rows over `model`

@ml.shard_map(mesh=mesh, in_specs=(plan, P("data", "model")), out_specs=P("data"))
def forward(model, x):
    return jax.lax.psum(model(x), "model")

y = forward(model, jnp.ones((8, 16)))
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from jax.sharding import AbstractMesh, Mesh

import meshlift as ml
from meshlift_shard_map.options import normalize
from meshlift_shard_map.staging import AxisNameError, stage

try:
    __version__ = version("meshlift-shard-map")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["BACKEND", "AxisNameError", "shard_map", "stage"]


@ml.takes_lift_options
def shard_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    in_specs: Any,
    out_specs: Any,
    mesh: Mesh | AbstractMesh | None = None,
    axis_names: Iterable[str] = frozenset(),
    check_vma: bool = True,
    jit: bool = True,
    check_rep: bool | None = None,
    auto: Iterable[str] | None = None,
    **lift: Any,
) -> Any:
    """`jax.shard_map` over functions of NNX modules, optimizers and arrays, with write-back.

    `in_specs`/`out_specs` are pytree prefixes of the positional arguments
    and the output; leaves are `PartitionSpec`, `NamedSharding`,
    `StateSharding` or `None` (replicated). Variables updated inside are
    written back with the spec they came in with. `mesh` is a `Mesh`, an
    `AbstractMesh` (matched against the `ml.use_mesh` mesh at each call),
    or omitted to use the `ml.use_mesh` mesh. `axis_names` are the manual
    axes (default: all). `check_vma` stays on unless you know why: without
    it the transpose of `psum` is `psum`, and gradients upstream of a
    row-parallel `psum` come out multiplied by the axis size. `jit=True`
    wraps the map in `jax.jit` (one compile, then cached), which is also
    what makes `donate_argnums` possible. `check_rep` and `auto` are
    the deprecated names from `jax.experimental.shard_map`; `graph` and
    `graph_updates` are `nnx.shard_map`'s (True, or None; tree mode is refused).

    Args:
        f: The function to lift; None gives a decorator.
        in_specs: Specs of the positional arguments (a pytree prefix).
        out_specs: Specs of the output (a pytree prefix).
        mesh: A `Mesh`, an `AbstractMesh`, or None for the mesh of `ml.use_mesh`.
        axis_names: The manual axes; empty: every axis of the mesh.
        check_vma: `jax.shard_map`'s varying-manual-axes check.
        jit: Wrap the map in `jax.jit`; False runs it eagerly (no donation).
        check_rep: The old name of `check_vma`; give one of the two.
        auto: The old complement of `axis_names`: the axes left automatic.
        **lift: The lift options, `ml.LiftOptions`: `static_argnums`, `static_argnames`,
            `donate_argnums`, `donate_argnames` as in `jax.jit` (donation needs
            `jit=True`); `graph`, `graph_updates` as in `nnx.shard_map` (True or None).

    Returns:
        The `Lifted` function, or, with `f=None`, a decorator making one.

    Raises:
        TypeError: If `mesh` is no `Mesh` or `AbstractMesh`, or old and new option
            names are mixed.
        ValueError: If `graph` or `graph_updates` is False, or the static or donated
            arguments do not fit `f`; at the first call, if there is no device mesh,
            `axis_names` names an axis the mesh lacks, an abstract `mesh` finds no mesh
            of its shape in context, or `jit=False` comes with donation.
        meshlift.PlanError: If a module stands where specs go; at a call, if a spec
            does not fit its argument.
        AxisNameError: At a call, if a collective names an axis that is not manual.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 8})
    model, x = nnx.Linear(16, 32, rngs=nnx.Rngs(0)), jnp.ones((64, 16))

    @ml.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    def forward(model, x):
        return model(x)

    y = forward(model, x)          # each device runs model on its 1/8 of x
    ```
    """
    options = {
        name: value
        for name, value, default in (
            ("axis_names", frozenset(axis_names), frozenset()),
            ("check_vma", check_vma, True),
            ("jit", jit, True),
            ("check_rep", check_rep, None),
            ("auto", auto, None),
        )
        if value != default
    }
    return ml.transform(
        BACKEND,
        f,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        **lift,
        **options,
    )


def read_mesh(mesh: Mesh | AbstractMesh | None) -> Any:
    """The mesh as `ml.shard_map` reads it.

    An AbstractMesh is matched, at each call, against the `ml.use_mesh` mesh of
    its shape.

    Args:
        mesh: A `Mesh`, an `AbstractMesh` or None.

    Returns:
        A `Mesh` or None as given; for an `AbstractMesh`, a function returning the
            matching mesh at each call (a ValueError there if there is none).

    Raises:
        TypeError: If `mesh` is none of these.
    """
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if not isinstance(mesh, AbstractMesh):
        raise TypeError(
            f"shard_map's mesh= takes a Mesh or an AbstractMesh, got {type(mesh).__name__}: "
            f"{mesh!r}; make one with ml.make_mesh({{'data': 2, 'model': 4}})"
        )

    def resolve() -> Mesh:
        concrete = ml.current_mesh()
        if isinstance(concrete, Mesh) and concrete.shape_tuple == mesh.shape_tuple:
            return concrete
        found = dict(concrete.shape) if concrete is not None else "no mesh"
        raise ValueError(
            f"shard_map was given the abstract mesh {dict(mesh.shape)}, which needs a "
            f"device mesh of that shape at the call site, but found {found}; call it "
            f"inside `with ml.use_mesh(mesh):` with such a mesh, or pass the Mesh itself"
        )

    return resolve


BACKEND = ml.Backend(
    name="shard_map",
    stage=stage,
    frontend=shard_map,
    read_mesh=read_mesh,
    read_options=normalize,
    version=__version__,
    distribution="meshlift-shard-map",
    capabilities={
        "manual-collectives",
        "partial-manual",
        "vma-gradients",
        "stages",
        "donation",
        "passes-through-none",
        "reshards-arguments",
    },
    description="jax.shard_map under jax.jit: per-device code with hand-written collectives",
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
