"""The ground floor: parameter paths, as messages name them (the errors are in `errors`).

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

Path: TypeAlias = tuple[Hashable, ...]


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
