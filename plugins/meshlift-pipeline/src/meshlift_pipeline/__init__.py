"""The pipeline backend for meshlift: `meshlift_pipeline.pipeline` and `ml.transform("pipeline", ...)`.

A step staged by this backend runs as under `ml.jit` (`jax.jit` with the plan's
shardings), except that each stack of layers the model runs with `ml.scan_layers`
runs pipelined: its layers split into stages along the mesh axis `stage_axis`, the
batch into `microbatches`, GPipe (`repeats=1`) or circular (`repeats > 1`). The same
model under `ml.jit` runs the stack as a plain scan: the reference.

Example:

```python
import jax, jax.numpy as jnp
import meshlift as ml
from jax.sharding import PartitionSpec as P
from meshlift_pipeline import pipeline

mesh = ml.make_mesh({"stage": 4, "data": 2})
weights = jax.device_put(jnp.ones((8, 3, 3)) / 3, jax.NamedSharding(mesh, P("stage")))

def forward(weights, x):
    y, _ = ml.scan_layers(lambda x, w: (jnp.tanh(x @ w), None), x, weights)
    return y

x = jnp.ones((8, 3))
y = pipeline(forward, microbatches=4, in_shardings=(P("stage"), P("data")), mesh=mesh)(weights, x)
assert jnp.allclose(y, ml.jit(forward)(weights, x), rtol=1e-6)
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import jax

import meshlift as ml
from meshlift.layers import running
from meshlift_pipeline.schedule import Schedule

try:
    __version__ = version("meshlift-pipeline")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["BACKEND", "Schedule", "pipeline", "stage"]


def stage(fn: Callable[..., Any], spec: ml.StageSpec) -> Any:
    """`jax.jit` over the pure function, whose stacks of layers run pipelined.

    Args:
        fn: The pure function the core built.
        spec: Its shardings, donated arguments, the pipeline's options and `jax.jit`'s.

    Returns:
        The `jax.jit`-wrapped function.
    """
    options = dict(spec.options)
    axis = options.pop("stage_axis")
    microbatches, repeats = options.pop("microbatches"), options.pop("repeats")
    schedule = Schedule(spec.mesh, axis, microbatches, repeats)

    @functools.wraps(fn)  # jax names the program after it: jit_train_step
    def pipelined(*args: Any) -> Any:
        with running(schedule.scan):
            return fn(*args)

    return jax.jit(
        pipelined,
        in_shardings=spec.in_specs,
        out_shardings=spec.out_specs,
        donate_argnums=spec.donate_argnums,
        **options,
    )


@ml.takes_lift_options
def pipeline(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    microbatches: int | None = None,
    repeats: int = 1,
    stage_axis: str = "stage",
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    compiler_options: dict[str, Any] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    **lift: Any,
) -> Any:
    """`ml.jit` whose layer stacks (`ml.scan_layers`) run as a pipeline over `stage_axis`.

    Takes `ml.jit`'s options (shardings, `mesh`, donation, statics) and the schedule's.

    Args:
        fun: The function to lift; None gives a decorator.
        microbatches: How many microbatches each stack's batch (the carry's leading
            axis) is split into; it must divide the batch. None: one per stage.
        repeats: How many times a microbatch passes the stages: 1 is GPipe; more is the
            circular schedule, stage `s` holding layer groups `s, s + S, ...` (needs
            `microbatches` at least the number of stages).
        stage_axis: The mesh axis the stages are laid over, one per device along it; a
            mesh without it runs each stack as one stage (microbatched, not pipelined),
            as MaxText does with a stage axis of size 1.
        in_shardings: As `ml.jit`'s.
        out_shardings: As `ml.jit`'s.
        keep_unused: `jax.jit`'s.
        compiler_options: `jax.jit`'s.
        mesh: As `ml.jit`'s; it must have the axis `stage_axis`.
        **lift: The lift options, `ml.LiftOptions`, as for `ml.jit`.

    Returns:
        The `Lifted` function, or, with `fun=None`, a decorator making one.

    Raises:
        ValueError: If `microbatches` (unless None) or `repeats` is not a positive int; at the first
            call, if a stack does not split as asked (its depth into stages x repeats,
            its batch into microbatches).

    Example:

    ```python
    def forward(weights, x):  # a stack of 8 layers, run by ml.scan_layers
        y, _ = ml.scan_layers(lambda x, w: (jnp.tanh(x @ w), None), x, weights)
        return y

    mesh = ml.make_mesh({"stage": 2, "data": 4})
    weights, x = jnp.ones((8, 4, 4)) / 4, jnp.ones((16, 4))
    circular = ml.pipeline(forward, microbatches=4, repeats=2, mesh=mesh,
                           in_shardings=(P("stage"), P("data")))
    assert jnp.allclose(circular(weights, x), ml.jit(forward)(weights, x))
    ```
    """
    options = {
        name: value
        for name, value, default in (
            ("keep_unused", keep_unused, False),
            ("compiler_options", compiler_options, None),
        )
        if value != default
    }
    return ml.transform(
        BACKEND,
        fun,
        mesh=mesh,
        in_specs=in_shardings,
        out_specs=out_shardings,
        microbatches=microbatches,
        repeats=repeats,
        stage_axis=stage_axis,
        **lift,
        **options,
    )


def read_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options `stage` receives: the schedule's checked (defaults filled in for
    `ml.transform("pipeline", ...)`), `jax.jit`'s as given.

    Args:
        options: The options given to `pipeline` or `ml.transform`.

    Returns:
        The options, `microbatches`, `repeats` and `stage_axis` among them.

    Raises:
        ValueError: If `microbatches` (unless None) or `repeats` is no positive int.
        TypeError: If `stage_axis` is no string.
    """
    options = {"microbatches": None, "repeats": 1, "stage_axis": "stage"} | dict(options)
    for name in ("microbatches", "repeats"):
        value = options[name]
        if name == "microbatches" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pipeline's {name} must be a positive int, got {value!r}")
    if not isinstance(options["stage_axis"], str):
        raise TypeError(f"pipeline's stage_axis is a mesh axis name, got {options['stage_axis']!r}")
    return options


BACKEND = ml.Backend(
    name="pipeline",
    stage=stage,
    frontend=pipeline,
    version=__version__,
    distribution="meshlift-pipeline",
    capabilities={"auto-partitioning", "global-rng", "stages", "donation", "multi-process"},
    description="jax.jit whose layer stacks (ml.scan_layers) run as a GPipe or circular "
    "pipeline over the mesh's stage axis",
    read_options=read_options,
)


@ml.hookimpl
def meshlift_register_backends(register: Callable[[ml.Backend], None]) -> None:
    register(BACKEND)
