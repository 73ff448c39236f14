"""The ground floor: parameter paths and the errors that name them.

A path is a tuple of keys whose first entry is the caller's argument name,
`("model", "linear1", "kernel")`; it is formatted once, for a message, as
`model.linear1.kernel`.

Example:

```python
from meshlift.paths import format_path

assert format_path(("model", "layers", 0, "kernel")) == "model.layers.0.kernel"
```
"""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Iterable
from typing import Any, TypeAlias

from jax.errors import UnexpectedTracerError

Path: TypeAlias = tuple[Hashable, ...]


class PlanError(ValueError):
    """A sharding plan does not fit the arguments it is applied to."""


class StructureChangedError(RuntimeError):
    """A lifted function changed its arguments in a way meshlift cannot carry back."""


class TraceLeakError(UnexpectedTracerError, RuntimeError):
    """Writing back would put a tracer into the caller's objects: an outer transform's, or
    one stored in a static value. Also JAX's `UnexpectedTracerError`, which reading that
    tracer later would raise, so an `except` written for JAX catches it."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)  # as it is, without a link to JAX's error page


class RetraceWarning(UserWarning):
    """A lifted function re-traces on every call: its trace changes a static value in place."""


def format_path(path: Iterable[Hashable]) -> str:
    """`("model", "layers", 0, "kernel")` -> `"model.layers.0.kernel"`."""
    return ".".join(str(part) for part in path) or "<root>"


def key_name(key: Any) -> str:
    """A jax key path entry as a plain name: `DictKey('w')` -> `'w'`."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def listing(paths: Iterable[str], limit: int = 3) -> str:
    """Up to `limit` backquoted paths, then how many more."""
    paths = list(paths)
    shown = ", ".join(f"`{p}`" for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def user_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn` that points at the first caller outside the
    libraries (meshlift, jax, flax), so a warning names the user's line."""
    libraries = tuple(
        os.path.dirname(module.__file__) + os.sep
        for module in map(sys.modules.get, ("meshlift", "jax", "flax"))
        if module is not None and module.__file__ is not None
    )
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(libraries):
        level, frame = level + 1, frame.f_back
    return level
