"""Switches for checking meshlift against itself: its fast paths off, or checked.

A lifted call normally skips work when nothing changed since the last call:
the call plan and the argument-layout cache trust the structure check
(`GraphSplit.unchanged`). Each of these is an optimisation of the slow,
plain path: split the arguments afresh, look the staged function up by its
structural key, run it. The oracle (`meshlift.testing.oracle`) runs
programs both ways:

* `slow_path()`: no call plan, no layout cache; every call takes the plain path.
* `checked_fast_paths()`: every time the structure check finds nothing
  changed, the graph is split again and compared; a change the check missed
  raises `AssertionError` naming the function.
* `python_loops()`: the C loops of `meshlift.speedups` replaced by their
  Python twins, as in an install without a compiler.

They are read when a lifted function makes a layout, so enter them before
the first call. Not thread-safe; for tests.

Example:

```python
import jax.numpy as jnp
import meshlift as ml
from meshlift import modes

with modes.slow_path():
    assert float(ml.jit(lambda x: x + 1)(jnp.ones(()))) == 2.0
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshlift import speedups

fast_paths = True  # False: every call takes the plain path
check_fast_paths = False  # True: a structure check's "unchanged" is verified


@contextlib.contextmanager
def _setting(name: str, value: bool) -> Iterator[None]:
    before = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = before


def slow_path() -> contextlib.AbstractContextManager[None]:
    """No call plan, no layout cache: every call takes the plain path."""
    return _setting("fast_paths", False)


def checked_fast_paths() -> contextlib.AbstractContextManager[None]:
    """Split again wherever the structure check finds nothing changed, and compare."""
    return _setting("check_fast_paths", True)


@contextlib.contextmanager
def python_loops() -> Iterator[None]:
    """The Python twins of `meshlift.speedups`' C loops in their place."""
    compiled = {name: getattr(speedups, name) for name in speedups.LOOPS}
    try:
        for name in speedups.LOOPS:
            setattr(speedups, name, getattr(speedups, f"_{name}"))
        yield
    finally:
        for name, loop in compiled.items():
            setattr(speedups, name, loop)
