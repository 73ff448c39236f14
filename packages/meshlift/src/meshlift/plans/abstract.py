"""Abstract models: shapes, dtypes and the shardings the annotations give, nothing allocated.

`ml.eval_shape` is `nnx.eval_shape` whose abstract arrays carry their
`NamedSharding` on the mesh in context, read from the annotations as every
meshlift plan reads them (`ml.with_partitioning`, logical names and rules), so
the result is a target for restoring a checkpoint straight onto the mesh.

Example:

```python
import jax, meshlift as ml
from flax import nnx
from jax.sharding import PartitionSpec as P

init = ml.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
mesh = ml.make_mesh({"data": 2, "model": 4})
with ml.use_mesh(mesh), ml.axis_rules([("embed", None), ("hidden", "model")]):
    abstract = ml.eval_shape(lambda: nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0)))
kernel = abstract.kernel.get_value()
assert isinstance(kernel, jax.ShapeDtypeStruct)
assert kernel.sharding == jax.NamedSharding(mesh, P(None, "model"))
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshlift import compat
from meshlift.plans.annotation import annotated_leaves
from meshlift.plans.mesh import current_mesh
from meshlift.plans.metadata import get_sharding

Result = TypeVar("Result")


def eval_shape(fun: Callable[..., Result], /, *args: Any, **kwargs: Any) -> Result:
    """`fun(*args, **kwargs)` evaluated abstractly, as `nnx.eval_shape`; nothing is allocated.

    Modules in the result hold `jax.ShapeDtypeStruct`s. Under `ml.use_mesh`
    (or `jax.set_mesh`) each annotated one carries its `NamedSharding` on
    that mesh, as `ml.get_sharding` gives it (an `ml.PlanError` names every
    parameter the mesh cannot shard); unannotated ones are replicated. The
    arguments are not changed.

    Args:
        fun: The function to evaluate, such as a module's constructor in a lambda.
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.

    Returns:
        What `fun` returns, its arrays as `jax.ShapeDtypeStruct`s.

    Raises:
        meshlift.PlanError: Under a mesh, listing every annotated parameter the mesh
            cannot shard.

    Example:

    ```python
    layer = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    out = ml.eval_shape(lambda m, x: m(x), layer, jnp.ones((8, 16)))
    assert out.shape == (8, 32) and isinstance(out, jax.ShapeDtypeStruct)
    ```
    """
    with compat.graph_mode():  # meshlift's semantics, whatever mode the user switched on
        out = nnx.eval_shape(fun, *args, **kwargs)
    mesh = current_mesh()
    if isinstance(mesh, Mesh):
        _place_abstract(out, mesh)
    return out


def _place_abstract(tree: Any, mesh: Mesh) -> None:
    """Give each abstract Variable of `tree` its sharding on `mesh`, in place."""
    get_sharding(tree, mesh)  # every problem of the plan, by path, before anything changes
    for item in annotated_leaves(tree):
        if isinstance(item.holder, nnx.Variable) and isinstance(item.value, jax.ShapeDtypeStruct):
            spec, _ = item.resolve(None, mesh)
            sharding = NamedSharding(mesh, spec)
            item.holder.set_raw_value(
                jax.ShapeDtypeStruct(item.shape, item.value.dtype, sharding=sharding)
            )
