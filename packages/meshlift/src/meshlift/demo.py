"""``meshlift demo``: train a tensor-parallel MLP on 8 simulated CPU devices.

The whole of meshlift in one file: an NNX model, one sharding plan, one mesh,
and a train step lifted with ``ml.jit``. Read it top to bottom as example code::

    meshlift demo --steps 100 --mesh data=2,model=4
    python -m meshlift.demo --json
"""

from __future__ import annotations

import os

# Simulate 8 CPU devices. XLA reads this when JAX first creates its devices, so it
# must be set before anything touches them (main() checks that it was in time).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml

# Megatron-style tensor parallelism: linear1 is split by columns, linear2 by rows,
# so the hidden activations never leave their "model" shard. Adam's state follows
# the same plan, because its paths end with the parameters' paths.
PLAN = ml.StateSharding(
    {
        ml.path_endswith("linear1", "kernel"): P(None, "model"),
        ml.path_endswith("linear1", "bias"): P("model"),
        ml.path_endswith("linear2", "kernel"): P("model", None),
        ...: P(),  # everything else replicated
    }
)

FEATURES, HIDDEN, BATCH = 64, 256, 64


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.linear2 = nnx.Linear(HIDDEN, FEATURES, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jax.nn.relu(self.linear1(x)))


def train_step(model: MLP, optimizer: nnx.Optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # updates land on the caller's model and optimizer
    return loss


def make_data(seed: int, steps: int):
    """A fixed synthetic regression task: y = sin(x @ A), with x ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(FEATURES, FEATURES)).astype(np.float32) / np.sqrt(FEATURES)
    for _ in range(steps):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        yield x, np.sin(x @ a)


def parameter_rows(model: nnx.Module) -> list[dict]:
    """Path, shape, dtype, and the sharding each parameter's array actually has."""
    rows = []
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            array = param[...]
            shard_shape = array.sharding.shard_shape(array.shape)
            rows.append(
                {
                    "path": ".".join(map(str, path)),
                    "shape": list(array.shape),
                    "dtype": str(array.dtype),
                    "spec": list(array.sharding.spec),
                    "bytes_per_device": math.prod(shard_shape) * array.dtype.itemsize,
                }
            )
    return rows


def train(steps: int, mesh_axes: dict[str, int], seed: int, show_progress: bool) -> dict:
    mesh = ml.make_mesh(mesh_axes)
    model = MLP(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = ml.jit(
        train_step,
        in_shardings=(PLAN, PLAN, P("data"), P("data")),  # model, optimizer, x, y
        out_shardings=P(),
        mesh=mesh,
    )

    losses = []
    start = time.perf_counter()
    with ml.use_mesh(mesh), _progress(show_progress) as progress:
        task = progress.add_task("training", total=steps, loss=float("nan"))
        for x, y in make_data(seed, steps):
            losses.append(float(step(model, optimizer, x, y)))
            progress.update(task, advance=1, loss=losses[-1])
    return {
        "mesh": dict(mesh.shape),
        "steps": steps,
        "seed": seed,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "losses": losses,
        "seconds": round(time.perf_counter() - start, 3),
        "params": parameter_rows(model),
    }


def _progress(show: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        disable=not show,
    )


def _print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"final loss [bold]{result['final_loss']:.4f}[/] (first {result['first_loss']:.4f}), "
        f"{result['steps']} steps on mesh {_mesh_str(result['mesh'])}, {result['seconds']:.1f}s"
    )
    table = Table(title="parameters after training (read from the arrays)")
    for column in ("path", "shape", "dtype", "sharding spec", "bytes per device"):
        table.add_column(column, justify="right" if column == "bytes per device" else "left")
    for row in result["params"]:
        table.add_row(
            row["path"],
            str(tuple(row["shape"])),
            row["dtype"],
            str(P(*row["spec"])),
            f"{row['bytes_per_device']:,}",
        )
    console.print(table)


def _mesh_str(axes: dict[str, int]) -> str:
    return " × ".join(f"{name}={size}" for name, size in axes.items())


def _mesh_arg(text: str) -> dict[str, int]:
    try:
        axes = {name.strip(): int(size) for name, size in (p.split("=") for p in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE,NAME=SIZE, got {text!r}") from None
    if set(axes) != {"data", "model"} or min(axes.values()) < 1:
        raise argparse.ArgumentTypeError(
            f"need positive sizes for axes 'data' and 'model', got {text!r}"
        )
    return axes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="meshlift demo",
        description="Train a small tensor-parallel MLP with meshlift on simulated CPU devices.",
        epilog="example: meshlift demo --steps 200 --mesh data=4,model=2 --seed 1",
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    parser.add_argument(
        "--mesh",
        type=_mesh_arg,
        default={"data": 2, "model": 4},
        help="mesh axes (default: data=2,model=4)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for the model and data (default: 0)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    # A mesh uses every device, and XLA_FLAGS only counts before JAX creates its devices.
    needed, available = math.prod(args.mesh.values()), jax.device_count()
    if needed != available:
        print(
            f"meshlift demo: the mesh {_mesh_str(args.mesh)} needs {needed} devices, but JAX has "
            f"{available} {jax.default_backend()} devices. Pass a --mesh whose sizes multiply to "
            f"{available}, or run the demo in a fresh process with JAX_PLATFORMS=cpu "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}: XLA reads that flag "
            "only when JAX first creates its devices, so it has no effect once JAX is in use.",
            file=sys.stderr,
        )
        return 1

    result = train(args.steps, args.mesh, args.seed, show_progress=not args.json)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
