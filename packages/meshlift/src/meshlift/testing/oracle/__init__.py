"""meshlift's differential oracle: generated programs run under a reference and a target.

Hand-picked tests cannot hold a promise as wide as "flax's graph semantics
under any backend". The oracle generates small programs (`programs`),
written in a fixed vocabulary (`vocabulary`), runs each under a reference
that can run the same code (eager execution, or `jax.jit` for programs of
arrays) and under a target (a meshlift backend, with its fast paths on, off
or checked), and compares outputs, final state, object identities, deleted
arrays, trace counts and errors (`runner`). A failing program is shrunk by
hypothesis and printed as a runnable snippet.

In a test:

```python
from hypothesis import given
from meshlift.testing import oracle

@oracle.budget(20)
@given(oracle.graph_programs())
def test_jit_agrees_with_eager(program):
    oracle.check(program, "ml.jit")
```

`budget(n)` runs `n` examples with a fixed seed; with `MESHLIFT_ORACLE_FUZZ=k`
in the environment it runs `k * n` random ones (`nox -s fuzz`; hypothesis's
`--hypothesis-seed` picks the seed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

from meshlift.testing.oracle.programs import Program, array_programs, graph_programs
from meshlift.testing.oracle.runner import PLAN, check, compare, lifting, replay, snippet

__all__ = [
    "PLAN",
    "Program",
    "array_programs",
    "budget",
    "check",
    "compare",
    "graph_programs",
    "lifting",
    "replay",
    "snippet",
]


def budget(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings for an oracle test: `examples` with a fixed seed, or, under
    `MESHLIFT_ORACLE_FUZZ=k`, `k * examples` from hypothesis's seed."""
    fuzz = int(os.environ.get("MESHLIFT_ORACLE_FUZZ", "0") or 0)
    return settings(
        max_examples=examples * fuzz if fuzz else examples,
        derandomize=not fuzz,
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
