"""meshlift: lift JAX's SPMD transforms over stateful models.

Example::

    import meshlift as ml
    from jax.sharding import PartitionSpec as P

    mesh = ml.make_mesh({"data": 2, "model": 4})
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    step = ml.jit(train_step, in_shardings=(plan, P("data")), mesh=mesh)
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
    """``jax.jit`` lifted over stateful models; needs the ``meshlift-jit`` backend.

    Takes every ``jax.jit`` option plus ``mesh=``; see ``meshlift_jit.jit``.

    Example::

        step = ml.jit(train_step, in_shardings=(plan, P("data")), mesh=mesh)
    """
    return plugins.get_frontend("jit")(fun, **kwargs)


def shard_map(f: Any = None, /, **kwargs: Any) -> Any:
    """``jax.shard_map`` lifted over stateful models; needs the ``meshlift-shard-map`` backend.

    Example::

        f = ml.shard_map(fn, mesh=mesh, in_specs=(plan, P("data")), out_specs=P("data"))
    """
    return plugins.get_frontend("shard_map")(f, **kwargs)


def pjit(fun: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Old ``pjit`` semantics (mesh from the call site) on today's JAX; needs ``meshlift-pjit``.

    Example::

        with ml.use_mesh(mesh):
            g = ml.pjit(fn, in_axis_resources=(plan, P("data")), out_axis_resources=P("data"))
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
