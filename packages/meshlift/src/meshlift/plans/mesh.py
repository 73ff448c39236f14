"""Meshes: making them and setting the call-site mesh.

Example:

```python
import meshlift as ml

mesh = ml.make_mesh({"data": 2, "model": 4})
with ml.use_mesh(mesh):
    ...  # bare PartitionSpecs in plans resolve against `mesh`
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from meshlift import compat


def make_mesh(
    axis_shapes: Mapping[str, int] | Sequence[int],
    axis_names: Sequence[str] | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: Sequence[AxisType] | None = None,
) -> Mesh:
    """Make a device mesh with `Auto` axis types (`jax.make_mesh` defaults to Explicit).

    `axis_shapes` is `{"data": 2, "model": 4}` or `(2, 4)` with `axis_names`.
    A mesh smaller than the device count uses the first devices, as `jax.make_mesh` does.

    Args:
        axis_shapes: `{axis name: size}` in mesh order, or the sizes alone (then give
            `axis_names`).
        axis_names: One name per entry of `axis_shapes`, when that is a sequence of sizes.
        devices: The devices to lay out; default: `jax.devices()`.
        axis_types: One `jax.sharding.AxisType` per axis; default: `Auto` for every axis.

    Returns:
        The `jax.sharding.Mesh`.

    Raises:
        TypeError: If names are given both as mapping keys and as `axis_names`, or not
            one per axis.
        ValueError: If the mesh needs more devices than are available.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    assert mesh.shape == {"data": 2, "model": 4}
    ```
    """
    if isinstance(axis_shapes, Mapping):
        if axis_names is not None:
            raise TypeError(
                "pass axis names either as the mapping's keys or as axis_names, not both"
            )
        axis_names = tuple(axis_shapes)
        axis_shapes = tuple(axis_shapes.values())
    if axis_names is None or len(axis_names) != len(axis_shapes):
        raise TypeError(
            f"make_mesh needs one name per axis: got shape {tuple(axis_shapes)} and names "
            f"{axis_names}; write ml.make_mesh({{'data': 2, 'model': 4}})"
        )
    needed = 1
    for size in axis_shapes:
        needed *= size
    available = len(devices) if devices is not None else jax.device_count()
    if needed > available:
        raise ValueError(
            f"a mesh of shape {dict(zip(axis_names, axis_shapes, strict=True))} needs {needed} "
            f"devices, but {available} are available; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before importing jax"
        )
    if axis_types is None:
        axis_types = (AxisType.Auto,) * len(axis_shapes)
    return jax.make_mesh(
        tuple(axis_shapes), tuple(axis_names), axis_types=tuple(axis_types), devices=devices
    )


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Set the call-site mesh for every backend (`jax.set_mesh` underneath).

    Args:
        mesh: The mesh that bare `PartitionSpec`s resolve against inside the block.

    Yields:
        `mesh` itself.

    Raises:
        TypeError: If `mesh` is not a `jax.sharding.Mesh`.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    double, x = ml.jit(lambda x: 2 * x, in_shardings=P("data")), jnp.arange(8.0)
    with ml.use_mesh(mesh):
        double(x)   # bare PartitionSpecs resolve against `mesh`
    ```
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"use_mesh takes a jax.sharding.Mesh, got {type(mesh).__name__}")
    with jax.set_mesh(mesh):
        yield mesh


def current_mesh(*, legacy: bool = False) -> Mesh | None:
    """The mesh in context at the call site, also inside traces; None if there is none.

    That is the mesh of `ml.use_mesh` / `jax.set_mesh`; with `legacy=True`,
    else the mesh of the deprecated `with mesh:` context (what old `pjit`
    code declares). Every part of meshlift looks the mesh up here.

    Args:
        legacy: Also look at the deprecated `with mesh:` context when no
            `ml.use_mesh` mesh is set.

    Returns:
        The concrete `Mesh` in context, or None.
    """
    mesh = compat.concrete_mesh()
    if mesh is None and legacy:
        mesh = compat.legacy_mesh()
    return mesh


class InMesh:
    """A staged function called in `jax.set_mesh(mesh)` where its caller has no mesh in
    context, so that `mesh=` given to a transform is the function's mesh context, as
    under `jax.set_mesh` (JAX reads it when it traces, and when it places the program);
    inside an outer trace, where `jax.set_mesh` cannot be entered, the call is made as
    it is. Its stages (`trace`, `lower`, `eval_shape`) are made in the mesh alike.

    Example:

    ```python
    from jax.sharding import PartitionSpec as P
    from meshlift.plans.mesh import InMesh

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    zeros = InMesh(jax.jit(lambda: jnp.zeros((8, 4), out_sharding=P("data"))), mesh)
    assert zeros().sharding.spec == P("data", None)
    ```
    """

    __slots__ = ("mesh", "staged")

    def __init__(self, staged: Callable[..., Any], mesh: Mesh):
        self.staged, self.mesh = staged, mesh

    def __call__(self, *args: Any) -> Any:
        if compat.concrete_mesh() is not None or not compat.outside_traces():
            return self.staged(*args)
        with jax.set_mesh(self.mesh):
            return self.staged(*args)

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.staged, name)
        if name in ("trace", "lower", "eval_shape"):
            return InMesh(found, self.mesh)
        return found  # _cache_size, clear_cache
