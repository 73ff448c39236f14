"""The core's front ends and the distributions that own their names.

`ml.jit`, `ml.shard_map`, `ml.pjit` and `ml.pipeline` run the backends named
"jit", "shard_map", "pjit" and "pipeline", and each name belongs to the distribution that the
core's extra of the same name installs (`pip install 'meshlift[jit]'`):
`meshlift.plugins` refuses another plugin that registers one of them.

Example:

```python
from meshlift.plugins.first_party import canonical, first_party_backends

assert first_party_backends()["jit"] == "meshlift-jit"
assert canonical("Meshlift_JIT") == "meshlift-jit"
```
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import metadata
from types import MappingProxyType

#: The core's front ends: `ml.jit` runs the backend named "jit", and so on.
FRONT_ENDS = ("jit", "shard_map", "pjit", "pipeline")


@functools.cache
def first_party_backends() -> Mapping[str, str]:
    """Front-end name -> the distribution whose backend it runs, as the core's extras
    declare them (`jit = ["meshlift-jit"]`); empty if meshlift is not installed.

    Returns:
        A read-only mapping such as `{"jit": "meshlift-jit", ...}`.

    Example:

    ```python
    assert ml.plugins.first_party_backends()["shard_map"] == "meshlift-shard-map"
    ```
    """
    try:
        requirements = metadata.requires("meshlift") or []
    except metadata.PackageNotFoundError:  # run from a source tree
        return MappingProxyType({})
    extras = {}
    for requirement in requirements:
        match = re.fullmatch(r'([\w.-]+)\s*;\s*extra\s*==\s*"([\w.-]+)"', requirement)
        if match:
            extras[fold(match.group(2))] = canonical(match.group(1))
    return MappingProxyType({name: extras[name] for name in FRONT_ENDS if name in extras})


def fold(name: str) -> str:
    """A name as backend names compare: `-` and `_` alike, and case."""
    return name.replace("-", "_").lower()


def canonical(distribution: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()
