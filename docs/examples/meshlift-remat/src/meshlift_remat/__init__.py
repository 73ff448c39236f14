"""A meshlift backend published outside meshlift: `jax.jit` over `jax.checkpoint`.

The whole lifted function is rematerialized: when something differentiates
through it from outside (a forward pass called inside `jax.grad`), its
intermediate values are recomputed on the backward pass instead of being
stored, as `policy` (a `jax.checkpoint_policies` name or function) says.
Everything else -- splitting modules into arrays, resolving the plan, writing
updates back -- is meshlift's; this module only maps a pure function over
arrays and its leaf-level shardings onto one JAX transform.

Example:

```python
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
import meshlift as ml

mesh = ml.make_mesh({"data": 2, "model": 4})
model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
forward = ml.transform("remat", lambda model, x: model(x), mesh=mesh,
                       in_specs=(plan, P("data")), out_specs=P("data"),
                       policy="nothing_saveable")
y = forward(model, jnp.ones((8, 16)))
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

import meshlift as ml

__all__ = ["BACKEND", "meshlift_register_backends", "stage"]

_CHECKPOINT_OPTIONS = ("policy", "prevent_cse")


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit(jax.checkpoint(fn))` with the core's shardings and donation.

    `spec.options` holds the keyword options given to `ml.transform`:
    `policy` and `prevent_cse` go to `jax.checkpoint`, the rest to
    `jax.jit`.
    """
    options = dict(spec.options)
    remat = {k: options.pop(k) for k in _CHECKPOINT_OPTIONS if k in options}
    if isinstance(remat.get("policy"), str):
        remat["policy"] = _policy(remat["policy"])
    return jax.jit(
        jax.checkpoint(fn, **remat),
        in_shardings=spec.in_specs,
        out_shardings=spec.out_specs,
        donate_argnums=spec.donate_argnums,
        **options,
    )


def _policy(name: str) -> Callable[..., Any]:
    policy = getattr(jax.checkpoint_policies, name, None)
    if policy is None:
        known = sorted(n for n in dir(jax.checkpoint_policies) if not n.startswith("_"))
        raise ValueError(f"unknown checkpoint policy {name!r}; jax.checkpoint_policies has {known}")
    return policy


BACKEND = ml.Backend(
    name="remat",
    stage=stage,
    # jax.jit underneath: the function sees global arrays and draws random numbers
    # globally; jax.jit's stages and donation carry over.
    capabilities={"auto-partitioning", "global-rng", "stages", "donation"},
    description="jax.jit over jax.checkpoint of the whole function (rematerialization)",
    # version and distribution are filled in from the installed distribution.
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
