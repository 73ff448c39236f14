"""The shard_map backend's options, and the legacy names it still accepts.

`check_rep` (the old name of `check_vma`) and `auto=S` (the axes left to
the compiler; the manual axes are the mesh's others) come from
`jax.experimental.shard_map`. Both are converted here, with a
`DeprecationWarning`, so that `stage` only ever sees the current names.

Example:

```python
from meshlift_shard_map.options import normalize

opts = normalize({"check_rep": False})   # warns
assert opts == {"axis_names": frozenset(), "auto_axes": frozenset(),
                "check_vma": False, "jit": True}
```
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

DEFAULTS: Mapping[str, Any] = {
    "axis_names": frozenset(),  # empty: manual over every mesh axis
    "auto_axes": frozenset(),  # what legacy `auto=` becomes
    "check_vma": True,
    "jit": True,
}
LEGACY = ("check_rep", "auto")


def normalize(options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of the backend with its default filled in and legacy names converted.

    Deprecation warnings point at the user's line, outside meshlift's packages.
    """
    unknown = set(options) - set(DEFAULTS) - set(LEGACY)
    if unknown:
        raise TypeError(
            f"shard_map got unknown options {sorted(unknown)}; it takes "
            f"{sorted(k for k in DEFAULTS if k != 'auto_axes')} (and the deprecated "
            f"{list(LEGACY)})"
        )
    out = {**DEFAULTS, **{k: v for k, v in options.items() if k not in LEGACY}}
    if options.get("check_rep") is not None:
        if "check_vma" in options and options["check_vma"] != options["check_rep"]:
            raise TypeError("check_rep is the old name of check_vma; pass only check_vma, not both")
        warnings.warn(
            "shard_map's check_rep= is deprecated: pass check_vma= instead (same meaning)",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        out["check_vma"] = bool(options["check_rep"])
    if options.get("auto") is not None:
        if out["axis_names"]:
            raise TypeError(
                "auto= and axis_names= both choose the manual axes; pass only "
                "axis_names (the mesh axes the function is manual over)"
            )
        warnings.warn(
            "shard_map's auto= is deprecated: pass axis_names= with the mesh axes the "
            "function is manual over (the mesh's axes minus the ones in auto)",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        out["auto_axes"] = _axis_set(options["auto"])
    out["axis_names"] = _axis_set(out["axis_names"])
    out["auto_axes"] = _axis_set(out["auto_axes"])
    return out


def manual_axes(options: Mapping[str, Any], mesh_axes: tuple[str, ...]) -> frozenset[str]:
    """The axes the function is manual over on a mesh with `mesh_axes`; checks the names."""
    named = options["axis_names"] or options["auto_axes"]
    stray = sorted(named - set(mesh_axes))
    if stray:
        which = "axis_names" if options["axis_names"] else "auto"
        raise ValueError(
            f"shard_map's {which} names {stray}, which the mesh (axes {list(mesh_axes)}) "
            f"lacks; use axes of the mesh"
        )
    if options["auto_axes"]:
        return frozenset(mesh_axes) - options["auto_axes"]
    return options["axis_names"] or frozenset(mesh_axes)


def _axis_set(names: str | Iterable[str]) -> frozenset[str]:
    return frozenset({names} if isinstance(names, str) else names)


_OWN_PACKAGES = ("meshlift", "meshlift_shard_map")


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first frame outside meshlift's packages."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _OWN_PACKAGES:
        frame, level = frame.f_back, level + 1
    return level
