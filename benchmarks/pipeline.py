#!/usr/bin/env python
"""Time per train step of a pipelined layer stack against the same step unpipelined.

The model is a stack of ``L`` residual blocks (``Linear(W, W)`` + tanh) made by
``nnx.vmap`` and run by ``ml.scan_layers``, trained with Adam on a batch of
``B``. Each row is one schedule on the 8 devices: ``S`` stages along a
``stage`` mesh axis (the rest of the devices on ``data``), ``M`` microbatches,
``R`` repeats. Side by side in one run, interleaved: ``ml.pipeline`` and
``ml.jit`` of the same step on the same mesh and plan (the stack's layers
split over ``stage``, which ``ml.jit`` gathers as the compiler sees fit).

The bubble is read from the compiled program: the pipeline loop's length ``T``
(the scan in the step's jaxpr) against the ``M * R`` stage steps that do work,
``1 - M R / T``, next to the schedule's theory ``(S - 1) / (M R + S - 1)``.

On simulated CPU devices the 8 devices share the machine's cores, so a
pipeline cannot overlap its stages there: the times say what the schedule
costs in work, and only a GPU run speaks for speed.

Run::

    python benchmarks/pipeline.py              # about 1 min on 2 cores
    python benchmarks/pipeline.py --json       # numbers only, on stdout
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import statistics
import time

import jax
import jax.extend
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import meshlift as ml

LAYERS, WIDTH, BATCH = 8, 64, 64
SCHEDULES = [(2, 4, 1), (2, 8, 2), (4, 4, 1), (4, 8, 1), (4, 8, 2), (8, 8, 1)]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = ml.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.linear = nnx.Linear(WIDTH, WIDTH, kernel_init=init, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class Stack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)

    def __call__(self, x):
        y, _ = ml.scan_layers(lambda x, block: (block(x), None), x, self.blocks)
        return y


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def scan_lengths(jaxpr) -> list[int]:
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            lengths.extend(scan_lengths(sub))
    return lengths


def setup(lift, stages: int, **options):
    mesh = ml.make_mesh({"stage": stages, "data": 8 // stages})
    with ml.use_mesh(mesh), ml.axis_rules([("layers", "stage"), ("embed", "data"), ("mlp", None)]):
        model = Stack(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    step = lift(train_step, in_shardings=(plan, plan, P("data"), P("data")), mesh=mesh, **options)
    x = jax.random.normal(jax.random.key(0), (BATCH, WIDTH))
    batch = (x, jnp.sin(x))
    step(model, optimizer, *batch).block_until_ready()  # compile
    return step, model, optimizer, batch


def per_step_ms(run, calls: int) -> float:
    step, model, optimizer, batch = run
    start = time.perf_counter()
    for _ in range(calls):
        loss = step(model, optimizer, *batch)
    loss.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e3


def measure(stages: int, microbatches: int, repeats: int, rounds: int, calls: int) -> dict:
    runs = {
        "ml.pipeline": setup(ml.pipeline, stages, microbatches=microbatches, repeats=repeats),
        "ml.jit": setup(ml.jit, stages),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(per_step_ms(run, calls))
    step, model, optimizer, batch = runs["ml.pipeline"]
    # the pipeline loop and its transpose; the other scans run a stage's layers
    lengths = scan_lengths(step.trace(model, optimizer, *batch).jax_traced.jaxpr.jaxpr)
    (loop,) = set(lengths) - {LAYERS // (stages * repeats)}
    pipelined, plain = (statistics.median(times[n]) for n in ("ml.pipeline", "ml.jit"))
    return {
        "stages": stages,
        "microbatches": microbatches,
        "repeats": repeats,
        "pipeline_ms": pipelined,
        "jit_ms": plain,
        "ratio": statistics.median(a / b for a, b in zip(*times.values(), strict=True)),
        "loop_steps": loop,
        "bubble_measured": 1 - microbatches * repeats / loop,
        "bubble_theory": (stages - 1) / (microbatches * repeats + stages - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row")
    parser.add_argument("--calls", type=int, default=10, help="steps per round and variant")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()
    rows = [measure(*schedule, args.rounds, args.calls) for schedule in SCHEDULES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(
        title=f"pipelined train step, {LAYERS} blocks of width {WIDTH}, batch {BATCH}, "
        f"{jax.device_count()} x {jax.devices()[0].platform} (median of {args.rounds} rounds)"
    )
    for column in ("S×M×R", "ml.pipeline ms", "ml.jit ms", "ratio", "loop", "bubble", "theory"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r['stages']}×{r['microbatches']}×{r['repeats']}",
            f"{r['pipeline_ms']:.2f}",
            f"{r['jit_ms']:.2f}",
            f"{r['ratio']:.2f}×",
            str(r["loop_steps"]),
            f"{r['bubble_measured']:.2f}",
            f"{r['bubble_theory']:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(
        "S stages (mesh axis `stage`, the other devices on `data`), M microbatches, R "
        "repeats; ratio: ml.pipeline over ml.jit of the same step, same mesh and plan; "
        "loop: the pipeline's stage steps in the traced step; bubble: 1 - M R / loop. "
        "Simulated CPU devices share the host's cores: stages cannot overlap here, so "
        "the ratio is the schedule's extra work, not a speed; only a GPU run speaks for speed."
    )


if __name__ == "__main__":
    main()
