"""Capabilities the conformance kit reads, and `requires` to declare a test's needs.

A backend claims capabilities from `meshlift.backend.CAPABILITIES`. The kit
reads these:

* `manual-collectives`: the function runs once per shard and writes its
  collectives out (`shard_map`); the kit gives it per-shard steps.
* `vma-gradients`: with `manual-collectives`, gradients of replicated
  values are summed over their axes (`shard_map`'s `check_vma=True`); a
  backend without it gets steps that average their own gradients, as pmap
  code does.
* `global-rng`: random draws inside the function equal those of an
  unsharded run (`jax.jit` draws globally; per-shard code draws per shard).
* `stages`: the staged callable has `trace` and `lower`; `Lowered.compile()`
  gives an object called like the function.
* `donation`: `donate_argnums` reuses the donated buffers.
* `passes-through-none`, `reshards-arguments`: how a call's arguments reach
  the function (`meshlift.testing.traits`); the core reads these too.

Example:

```python
from meshlift.testing import requires

@requires("stages")
def test_my_lowering(meshlift_backend): ...
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import meshlift as ml

MANUAL = "manual-collectives"
VMA_GRADIENTS = "vma-gradients"
GLOBAL_RNG = "global-rng"
STAGES = "stages"
DONATION = "donation"

_ATTRIBUTE = "meshlift_requires"


def requires(*capabilities: str) -> Callable[[Any], Any]:
    """Mark a test as needing these capabilities: a backend lacking one must fail it.

    The plugin turns that into a strict xfail with the reason, so a backend
    that lacks a capability but passes anyway is told to declare it.
    """

    def mark(test: Any) -> Any:
        setattr(test, _ATTRIBUTE, (*getattr(test, _ATTRIBUTE, ()), *capabilities))
        return test

    return mark


def required_by(test: Any) -> tuple[str, ...]:
    return tuple(getattr(test, _ATTRIBUTE, ()))


def missing(backend: ml.Backend, required: Iterable[str]) -> set[str]:
    """The capabilities of `required` that `backend` lacks."""
    return set(required) - set(backend.capabilities)
