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

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# The public names, each imported from its submodule the first time it is used (PEP 562),
# so that `import meshlift` and the `meshlift` command line start without importing jax.
# A new public name is one entry here, one import in the TYPE_CHECKING block below and
# one entry in __all__ (tests/test_cli_imports.py checks that the three agree).
_LAZY: dict[str, str] = {
    "eval_shape": "meshlift.plans.abstract",
    "Backend": "meshlift.backend",
    "Specs": "meshlift.backend",
    "StageSpec": "meshlift.backend",
    "Explanation": "meshlift.tools.explain",
    "explain": "meshlift.tools.explain",
    "hookimpl": "meshlift.hookspecs",
    "Lifted": "meshlift.call.lift",
    "LiftOptions": "meshlift.call.options",
    "takes_lift_options": "meshlift.call.options",
    "transform": "meshlift.call.transform",
    "AxisRuleWarning": "meshlift.errors",
    "axis_rules": "meshlift.plans.logical",
    "logical_to_mesh": "meshlift.plans.logical",
    "logical_to_mesh_axes": "meshlift.plans.logical",
    "logical_to_mesh_sharding": "meshlift.plans.logical",
    "with_logical_constraint": "meshlift.plans.logical",
    "current_mesh": "meshlift.plans.mesh",
    "make_mesh": "meshlift.plans.mesh",
    "use_mesh": "meshlift.plans.mesh",
    "scan_layers": "meshlift.layers",
    "add_axis": "meshlift.plans.metadata",
    "get_partition_spec": "meshlift.plans.metadata",
    "get_sharding": "meshlift.plans.metadata",
    "remove_axis": "meshlift.plans.metadata",
    "replace_boxed": "meshlift.plans.metadata",
    "unbox": "meshlift.plans.metadata",
    "with_logical_partitioning": "meshlift.plans.metadata",
    "with_partitioning": "meshlift.plans.metadata",
    "PlanError": "meshlift.errors",
    "RetraceWarning": "meshlift.errors",
    "StructureChangedError": "meshlift.errors",
    "TraceLeakError": "meshlift.errors",
    "BackendNotFoundError": "meshlift.errors",
    "backends": "meshlift.plugins",
    "get_backend": "meshlift.plugins",
    "get_frontend": "meshlift.plugins",
    "StateSharding": "meshlift.plans.sharding",
    "path_endswith": "meshlift.plans.sharding",
    "Compiled": "meshlift.call.stages",
    "Lowered": "meshlift.call.stages",
    "Traced": "meshlift.call.stages",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports these
    __version__: str

    from meshlift import plugins
    from meshlift.backend import Backend, Specs, StageSpec
    from meshlift.call.lift import Lifted
    from meshlift.call.options import LiftOptions, takes_lift_options
    from meshlift.call.stages import Compiled, Lowered, Traced
    from meshlift.call.transform import transform
    from meshlift.errors import (
        AxisRuleWarning,
        BackendNotFoundError,
        PlanError,
        RetraceWarning,
        StructureChangedError,
        TraceLeakError,
    )
    from meshlift.hookspecs import hookimpl
    from meshlift.layers import scan_layers
    from meshlift.plans.abstract import eval_shape
    from meshlift.plans.logical import (
        axis_rules,
        logical_to_mesh,
        logical_to_mesh_axes,
        logical_to_mesh_sharding,
        with_logical_constraint,
    )
    from meshlift.plans.mesh import current_mesh, make_mesh, use_mesh
    from meshlift.plans.metadata import (
        add_axis,
        get_partition_spec,
        get_sharding,
        remove_axis,
        replace_boxed,
        unbox,
        with_logical_partitioning,
        with_partitioning,
    )
    from meshlift.plans.sharding import StateSharding, path_endswith
    from meshlift.plugins import backends, get_backend, get_frontend
    from meshlift.tools.explain import Explanation, explain
else:  # hidden from type checkers, so that a misspelt `ml.jti` is still an error there

    def __getattr__(name: str) -> Any:
        """Import a public name's submodule on first use, and keep the name here."""
        module = _LAZY.get(name)
        if name == "__version__":
            value = _version()
        elif module is not None:
            value = getattr(importlib.import_module(module), name)
        elif (
            name.isidentifier()
            and not name.startswith("__")
            and importlib.util.find_spec(f"{__name__}.{name}") is not None
        ):
            value = importlib.import_module(f"{__name__}.{name}")  # `ml.plugins`, `ml.graph`
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value  # later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshlift")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def _frontend(name: str) -> Any:
    from meshlift import plugins

    return plugins.get_frontend(name)


if TYPE_CHECKING:  # the front ends' signatures, from a stub: the core imports no plugin
    from meshlift.frontends import jit, pipeline, pjit, shard_map
else:  # at run time each forwards to its backend's front end, found through the plugins

    def jit(fun: Any = None, /, **kwargs: Any) -> Any:
        """`jax.jit` lifted over stateful models; needs the `meshlift-jit` backend.

        Takes every `jax.jit` option plus `mesh=`; see `meshlift_jit.jit`.

        Args:
            fun: The function to lift; None gives a decorator.
            **kwargs: `meshlift_jit.jit`'s keywords (`in_shardings`, `mesh`...).

        Returns:
            The `Lifted` function, or a decorator making one.

        Raises:
            BackendNotFoundError: If the `meshlift-jit` backend is not installed.
            meshlift.errors.PluginError: If its backend has no front end.

        Example:

        ```python
        mesh = ml.make_mesh({"data": 2, "model": 4})
        double = ml.jit(lambda x: 2 * x, in_shardings=P("data"), mesh=mesh)
        assert double(jnp.arange(8.0)).sharding.spec == P("data")
        ```
        """
        return _frontend("jit")(fun, **kwargs)

    def shard_map(f: Any = None, /, **kwargs: Any) -> Any:
        """`jax.shard_map` lifted over stateful models; needs the `meshlift-shard-map` backend.

        Args:
            f: The function to lift; None gives a decorator.
            **kwargs: `meshlift_shard_map.shard_map`'s keywords (`in_specs`, `out_specs`,
                `mesh`...).

        Returns:
            The `Lifted` function, or a decorator making one.

        Raises:
            BackendNotFoundError: If the `meshlift-shard-map` backend is not installed.
            meshlift.errors.PluginError: If its backend has no front end.

        Example:

        ```python
        mesh = ml.make_mesh({"data": 8})
        forward = ml.shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=P("data"))
        layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        assert forward(layer, jnp.ones((8, 4))).shape == (8, 4)   # each device: one row
        ```
        """
        return _frontend("shard_map")(f, **kwargs)

    def pjit(fun: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Old `pjit` semantics (mesh from the call site) on today's JAX; needs `meshlift-pjit`.

        Args:
            fun: The function to lift.
            *args: `meshlift_pjit.pjit`'s positional arguments (`in_axis_resources`...).
            **kwargs: Its keywords.

        Returns:
            The `Lifted` function.

        Raises:
            BackendNotFoundError: If the `meshlift-pjit` backend is not installed.
            meshlift.errors.PluginError: If its backend has no front end.

        Example:

        ```python
        double = ml.pjit(lambda x: 2 * x, in_axis_resources=P("data"), out_axis_resources=None)
        x = jnp.arange(8.0)                 # made outside: under the mesh it is committed
        with ml.use_mesh(ml.make_mesh({"data": 2, "model": 4})):
            assert double(x).sharding.is_fully_replicated
        ```
        """
        return _frontend("pjit")(fun, *args, **kwargs)

    def pipeline(fun: Any = None, /, **kwargs: Any) -> Any:
        """`ml.jit` whose layer stacks (`ml.scan_layers`) run as a pipeline over the mesh's
        `stage` axis; needs the `meshlift-pipeline` backend.

        Args:
            fun: The function to lift; None gives a decorator.
            **kwargs: `meshlift_pipeline.pipeline`'s keywords (`microbatches`, `repeats`,
                `stage_axis`, `in_shardings`, `mesh`...).

        Returns:
            The `Lifted` function, or a decorator making one.

        Raises:
            BackendNotFoundError: If the `meshlift-pipeline` backend is not installed.
            meshlift.errors.PluginError: If its backend has no front end.

        Example:

        ```python
        def forward(weights, x):
            y, _ = ml.scan_layers(lambda x, w: (jnp.tanh(x @ w), None), x, weights)
            return y

        mesh = ml.make_mesh({"stage": 4, "data": 2})
        weights, x = jnp.ones((8, 4, 4)) / 4, jnp.ones((8, 4))
        y = ml.pipeline(forward, microbatches=2, in_shardings=(P("stage"), P("data")),
                        mesh=mesh)(weights, x)   # 4 stages of 2 layers, 2 microbatches
        assert jnp.allclose(y, ml.jit(forward)(weights, x))
        ```
        """
        return _frontend("pipeline")(fun, **kwargs)


__all__ = [
    "AxisRuleWarning",
    "Backend",
    "BackendNotFoundError",
    "Compiled",
    "Explanation",
    "LiftOptions",
    "Lifted",
    "Lowered",
    "PlanError",
    "RetraceWarning",
    "Specs",
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
    "eval_shape",
    "explain",
    "get_backend",
    "get_frontend",
    "get_partition_spec",
    "get_sharding",
    "hookimpl",
    "jit",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "make_mesh",
    "path_endswith",
    "pipeline",
    "pjit",
    "plugins",
    "remove_axis",
    "replace_boxed",
    "scan_layers",
    "shard_map",
    "takes_lift_options",
    "transform",
    "unbox",
    "use_mesh",
    "with_logical_constraint",
    "with_logical_partitioning",
    "with_partitioning",
]
