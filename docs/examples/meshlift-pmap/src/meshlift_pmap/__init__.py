"""A meshlift backend published outside meshlift: `jax.pmap` code on today's JAX.

`pmap(f, axis_name, in_axes=..., out_axes=...)` runs `f` once per device as
`jax.pmap` did: each mapped argument has one entry per device along its
`in_axes` axis, which `f` does not see; collectives over `axis_name`
(`jax.lax.pmean`, `psum`) work; and gradients have pmap's semantics, so code
averages its own gradients with `pmean`. Underneath is `jax.shard_map`
(`check_vma=False`) under `jax.jit` on a one-axis mesh of the devices, and
meshlift: Flax NNX modules and optimizers are arguments like arrays, and what
`f` changes on them is written back.

Example:

```python
import jax
import jax.numpy as jnp
from meshlift_pmap import pmap

n = jax.device_count()
total = pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jnp.arange(float(n)))
assert total.tolist() == [n * (n - 1) / 2] * n
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import meshlift as ml

__all__ = ["BACKEND", "meshlift_register_backends", "pmap", "stage"]

# The mesh axis of a pmap without an axis_name: collectives cannot name it, as in jax.pmap.
UNNAMED = "_pmap"


def pmap(
    fun: Callable[..., Any] | None = None,
    axis_name: str | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Iterable[int] = (),
    devices: Sequence[jax.Device] | None = None,
    donate_argnums: int | Iterable[int] = (),
) -> Any:
    """`jax.pmap`'s arguments, run with meshlift on `jax.shard_map`.

    `in_axes`/`out_axes` are ints (the mapped axis) or None (the same value
    on every device), or pytree prefixes of them; a tuple `in_axes` has one
    entry per positional argument, static ones included, as in `jax.pmap`.
    A graph node (a module, an optimizer) usually takes `None`: one copy,
    replicated, updated in place.

    Example:

    ```python
    import functools
    import jax
    import jax.numpy as jnp
    from meshlift_pmap import pmap

    @functools.partial(pmap, axis_name="batch", in_axes=(None, 0))
    def shift(offset, x):
        return x - jax.lax.pmean(x, "batch") + offset

    out = shift(1.0, jnp.arange(8.0).reshape(8, 1))
    assert out.shape == (8, 1) and float(out.mean()) == 1.0
    ```
    """
    if fun is None:
        return functools.partial(
            pmap,
            axis_name=axis_name,
            in_axes=in_axes,
            out_axes=out_axes,
            static_broadcasted_argnums=static_broadcasted_argnums,
            devices=devices,
            donate_argnums=donate_argnums,
        )
    statics = _ints(static_broadcasted_argnums)
    if isinstance(in_axes, tuple):  # the core's specs count the dynamic arguments only
        in_axes = tuple(axes for i, axes in enumerate(in_axes) if i not in statics)
    name = UNNAMED if axis_name is None else axis_name
    mesh = Mesh(np.array(jax.local_devices() if devices is None else list(devices)), (name,))
    return ml.transform(
        BACKEND,
        fun,
        mesh=mesh,
        static_argnums=statics,
        donate_argnums=_ints(donate_argnums),
        in_axes=in_axes,
        out_axes=out_axes,
        axis_name=name,
    )


def read_specs(in_specs: Any, out_specs: Any, options: Mapping[str, Any]) -> ml.Specs:
    """pmap's `in_axes`/`out_axes` as specs over its axis: `0` is `P(axis)`, `1` is
    `P(None, axis)`, `None` is `P()`. Without `axis_name` (`ml.transform("pmap", ...)`
    with specs, as the conformance kit calls it) the specs are read as given."""
    axis = options.get("axis_name")
    if axis is None:
        return ml.Specs(in_specs, out_specs)
    return ml.Specs(
        _axes_as_specs(options.get("in_axes", 0), axis, "in_axes"),
        _axes_as_specs(options.get("out_axes", 0), axis, "out_axes"),
        names=("in_axes", "out_axes"),
    )


def read_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """What `stage` needs: the axis to take away inside the function, if any."""
    return {k: v for k, v in options.items() if k not in ("in_axes", "out_axes")}


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit(jax.shard_map(fn, check_vma=False))`, each mapped axis taken away inside
    when pmap's front end asked for it (`axis_name` among the options)."""
    options = dict(spec.options)
    axis = options.pop("axis_name", None)
    if options:
        raise TypeError(f"pmap got options it does not take: {sorted(options)}")
    if not isinstance(spec.mesh, Mesh):
        raise ValueError(f"pmap needs a concrete device mesh, got {spec.mesh!r}")
    in_specs = ml.backend.shard_map_specs(spec.in_specs)
    out_specs = ml.backend.shard_map_specs(spec.out_specs)
    body = fn if axis is None else _per_device(fn, axis, spec.mesh.shape[axis], in_specs, out_specs)
    mapped = jax.shard_map(
        body, mesh=spec.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    return jax.jit(
        mapped,
        in_shardings=spec.in_specs,
        out_shardings=spec.out_specs,
        donate_argnums=spec.donate_argnums,
    )


def _per_device(
    fn: Callable[..., Any], axis: str, devices: int, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
    """`fn` as pmap calls it: each argument's mapped axis (one entry per device) taken
    away, and put back on each output mapped by `out_axes`."""

    def take(dim: int, x: jax.Array) -> jax.Array:
        if x.shape[dim] != 1:
            shape = (*x.shape[:dim], x.shape[dim] * devices, *x.shape[dim + 1 :])
            raise ValueError(
                f"pmap maps axis {dim} of an argument of shape {shape} over {devices} devices, "
                f"so that axis must have {devices} entries, one per device (as in jax.pmap). "
                f"Reshape it to put the devices first, or map it with in_axes=None."
            )
        return jnp.squeeze(x, dim)

    @functools.wraps(fn)
    def body(*args: Any) -> Any:
        out = fn(*_each_mapped(in_specs, args, axis, take))
        return _each_mapped(out_specs, out, axis, lambda dim, x: jnp.expand_dims(x, dim))

    return body


def _each_mapped(specs: Any, tree: Any, axis: str, f: Callable[[int, Any], Any]) -> Any:
    """`tree` with `f(dim, leaf)` applied to each leaf whose spec maps `axis` at `dim`."""

    def under(spec: P, subtree: Any) -> Any:
        dims = [dim for dim, entry in enumerate(spec) if entry == axis]
        return subtree if not dims else jax.tree.map(functools.partial(f, dims[0]), subtree)

    return jax.tree.map(under, specs, tree, is_leaf=lambda s: isinstance(s, P))


def _axes_as_specs(axes: Any, axis: str, name: str) -> Any:
    def spec(dim: int | None) -> P:
        if dim is None:
            return P()
        if not isinstance(dim, int) or dim < 0:
            raise ValueError(
                f"{name} takes axes counted from the front (0, 1, ...) or None, got {dim!r}"
            )
        return P(*[None] * dim, axis)

    return jax.tree.map(spec, axes, is_leaf=lambda x: x is None)


def _ints(value: int | Iterable[int]) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


BACKEND = ml.Backend(
    name="pmap",
    stage=stage,
    frontend=pmap,
    read_specs=read_specs,
    read_options=read_options,
    # One program per device with written-out collectives, and pmap's gradients: no
    # `vma-gradients` (the kit gives it steps that pmean their own gradients).
    capabilities={"manual-collectives", "stages", "donation"},
    description="jax.pmap's semantics (axis_name, in_axes, pmean'd gradients) on jax.shard_map",
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
