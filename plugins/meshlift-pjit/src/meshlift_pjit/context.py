"""The call-site mesh, looked up at each call the way old `pjit` code declares it.

Order: `ml.use_mesh(mesh)` / `jax.set_mesh(mesh)` first, then the
deprecated `with mesh:` context. No mesh is allowed where nothing needs
one (no specs, `NamedSharding` specs, `None`), as in old `pjit`.

Example:

```python
import meshlift as ml
from meshlift_pjit import call_site_mesh

mesh = ml.make_mesh({"data": 2, "model": 4})
with ml.use_mesh(mesh):
    assert call_site_mesh() == mesh
```
"""

from __future__ import annotations

from jax.sharding import Mesh

import meshlift as ml


def call_site_mesh() -> Mesh | None:
    """The concrete mesh in context at the call, or None if there is none.

    Works inside traces (an outer `jax.jit`, `jax.vmap`, `jax.grad`) too.
    With no mesh, as in old `pjit`, specs that need one are refused when
    they are resolved, naming the argument.
    """
    return ml.current_mesh(legacy=True)
