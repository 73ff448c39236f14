"""The plugin contract: every hook meshlift calls, read top to bottom.

A plugin is a module (or object) with functions marked `@meshlift.hookimpl`
whose names match the specs below, published under the `meshlift`
entry-point group. A plugin with a function meshlift would not call (an
unknown `meshlift_*` name, an unmarked hook) fails to load, named:

```toml
# pyproject.toml of a backend distribution
[project.entry-points.meshlift]
my_backend = "my_backend_package"
```

```python
# my_backend_package/__init__.py
import meshlift as ml

@ml.hookimpl
def meshlift_register_backends(register):
    register(ml.Backend(name="my-backend", stage=my_stage))
```
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from meshlift.backend import Backend

hookspec = pluggy.HookspecMarker("meshlift")
hookimpl = pluggy.HookimplMarker("meshlift")


@hookspec
def meshlift_register_backends(register: Callable[[Backend], None]) -> None:
    """Register backends by calling `register(backend)` once per backend.

    Called once, when the registry is first used. Registering two backends
    with the same name is an error that names both distributions.

    Args:
        register: Call it with each `meshlift.Backend` the plugin provides.
    """
