"""meshlift: lift JAX's SPMD transforms over stateful models.

Example:

```python
import jax.numpy as jnp
import meshlift as ml
from flax import nnx
from jax.sharding import PartitionSpec as P

mesh = ml.make_mesh({"data": 2, "model": 4})
plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
forward = ml.jit(lambda m, x: m(x), in_shardings=(plan, P("data")), mesh=mesh)
layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
assert forward(layer, jnp.ones((8, 4))).shape == (8, 8)
assert layer.kernel[...].sharding.spec == P(None, "model")
```
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from meshlift import plugins
from meshlift.backend import Backend, StageSpec
from meshlift.explain import Explanation, explain
from meshlift.hookspecs import hookimpl
from meshlift.lift import Lifted, transform
from meshlift.logical import (
    axis_rules,
    logical_to_mesh,
    logical_to_mesh_axes,
    logical_to_mesh_sharding,
    with_logical_constraint,
)
from meshlift.mesh import current_mesh, make_mesh, use_mesh
from meshlift.metadata import (
    add_axis,
    get_partition_spec,
    get_sharding,
    remove_axis,
    replace_boxed,
    unbox,
    with_logical_partitioning,
    with_partitioning,
)
from meshlift.paths import PlanError, StructureChangedError, TraceLeakError
from meshlift.plugins import BackendNotFoundError, backends, get_backend
from meshlift.sharding import StateSharding, path_endswith
from meshlift.stages import Compiled, Lowered, Traced

try:
    __version__ = version("meshlift")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"


def jit(fun: Any = None, /, **kwargs: Any) -> Any:
    """`jax.jit` lifted over stateful models; needs the `meshlift-jit` backend.

    Takes every `jax.jit` option plus `mesh=`; see `meshlift_jit.jit`.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    double = ml.jit(lambda x: 2 * x, in_shardings=P("data"), mesh=mesh)
    assert double(jnp.arange(8.0)).sharding.spec == P("data")
    ```
    """
    return plugins.get_frontend("jit")(fun, **kwargs)


def shard_map(f: Any = None, /, **kwargs: Any) -> Any:
    """`jax.shard_map` lifted over stateful models; needs the `meshlift-shard-map` backend.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 8})
    forward = ml.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(P(), P("data")),
                           out_specs=P("data"))
    layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    assert forward(layer, jnp.ones((8, 4))).shape == (8, 4)   # each device: one row
    ```
    """
    return plugins.get_frontend("shard_map")(f, **kwargs)


def pjit(fun: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Old `pjit` semantics (mesh from the call site) on today's JAX; needs `meshlift-pjit`.

    Example:

    ```python
    double = ml.pjit(lambda x: 2 * x, in_axis_resources=P("data"), out_axis_resources=None)
    x = jnp.arange(8.0)                 # made outside: under the mesh it is committed
    with ml.use_mesh(ml.make_mesh({"data": 2, "model": 4})):
        assert double(x).sharding.is_fully_replicated
    ```
    """
    return plugins.get_frontend("pjit")(fun, *args, **kwargs)


__all__ = [
    "Backend",
    "BackendNotFoundError",
    "Compiled",
    "Explanation",
    "Lifted",
    "Lowered",
    "PlanError",
    "StageSpec",
    "StateSharding",
    "StructureChangedError",
    "TraceLeakError",
    "Traced",
    "__version__",
    "add_axis",
    "axis_rules",
    "backends",
    "current_mesh",
    "explain",
    "get_backend",
    "get_partition_spec",
    "get_sharding",
    "hookimpl",
    "jit",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "make_mesh",
    "path_endswith",
    "pjit",
    "plugins",
    "remove_axis",
    "replace_boxed",
    "shard_map",
    "transform",
    "unbox",
    "use_mesh",
    "with_logical_constraint",
    "with_logical_partitioning",
    "with_partitioning",
]
