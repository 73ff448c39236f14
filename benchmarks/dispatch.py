#!/usr/bin/env python
"""Per-call dispatch time of a small train step, meshlift against its baselines.

The step is forward, grad and an Adam update of an MLP of width 64
(``Linear(64, 64)`` + relu, repeated ``L`` times), input ``(1, 64)``, MSE
loss. The compute is tiny, so the time per call is almost all Python-side
dispatch: splitting and merging the model, flattening pytrees, checking the
compile cache, writing updates back. Variants, side by side in one run:

* ``meshlift.jit``          -- ``ml.jit(train_step)(model, optimizer, x, y)``
* ``nnx.jit``               -- flax's default graph mode, same call
* ``nnx.jit(graph=False)``  -- flax's tree mode, same call
* ``jax.jit floor``         -- raw ``jax.jit`` over a dict of arrays and the
  optax state, outputs fed back in: what no wrapper can beat
* ``meshlift.shard_map``    -- ``ml.shard_map`` of the same step, data parallel
  on 8 devices (parameters ``P()``, batch ``P("data")``, loss ``pmean``'d)
* ``jax.shard_map floor``   -- the same data-parallel step as raw
  ``jax.shard_map`` under ``jax.jit`` over arrays: ``meshlift.shard_map``'s floor

Run::

    python benchmarks/dispatch.py                      # L = 4 32 128, about 3 min
    python benchmarks/dispatch.py --layers 4 --repeats 0.2   # quick smoke run
    python benchmarks/dispatch.py --json               # numbers only, on stdout

See ``benchmarks/README.md`` for how to read the ratios.
"""

from __future__ import annotations

import os

# Must happen before jax is imported: the figures in DESIGN.md are taken with
# 8 simulated CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import collections
import gc
import json
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import meshlift as ml

WIDTH = 64
LEARNING_RATE = 1e-3
WARMUP_CALLS = 3  # the first compiles; all three are checked against the floor
FLOOR = "jax.jit floor"
SHARD_MAP_FLOOR = "jax.shard_map floor"
# Each variant's ratio is to its own floor: the jax.jit floor unless named here.
BASELINE = {"meshlift.shard_map": SHARD_MAP_FLOOR}
# The shard_map variants' 1-D "data" mesh (--shard-map-devices). One device, like
# every other variant: with 8 simulated devices on a 2-core host the step's
# execution, not its dispatch, takes most of each call; see benchmarks/README.md.
DATA_DEVICES = 1

# Python-side trace counters: train_step bumps its variant's entry, which only
# happens while JAX traces it. One trace per variant and depth is expected.
TRACES: collections.Counter[str] = collections.Counter()

# A variant's per-call protocol: ``call(state) -> (state, result)``. Stateful
# variants hand their state back unchanged; the floor threads new arrays.
State = Any
Call = Callable[[State], tuple[State, Any]]


# --------------------------------------------------------------------------
# The model and the step
# --------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, layers: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


def make_train_step(name: str, data_axis: str | None = None):
    """A fresh ``train_step`` (its own jit cache entry) that counts its traces.

    With ``data_axis`` it is the per-shard step of data parallelism: the loss is
    averaged over the axis (``pmean``) inside the differentiated function, so
    the gradients come out averaged over the whole batch.
    """

    def train_step(model, optimizer, x, y):
        TRACES[name] += 1

        def loss_fn(model):
            loss = jnp.mean((model(x) - y) ** 2)
            return jax.lax.pmean(loss, data_axis) if data_axis else loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def make_batch():
    x = jax.random.normal(jax.random.key(1), (1, WIDTH))
    y = jax.random.normal(jax.random.key(2), (1, WIDTH))
    return x, y


def data_mesh(devices: int) -> jax.sharding.Mesh:
    """The shard_map variants' 1-D "data" mesh of the first `devices` devices."""
    return ml.make_mesh({"data": devices}, devices=jax.devices()[:devices])


def shard_over_data(mesh: jax.sharding.Mesh, batch: tuple[jax.Array, ...]):
    """`batch` repeated once per device, split over "data": each shard sees the
    original rows, so the data-parallel step computes the floor's numbers."""
    sharding, copies = NamedSharding(mesh, P("data")), mesh.shape["data"]
    return tuple(jax.device_put(jnp.tile(a, (copies, 1)), sharding) for a in batch)


def make_model(layers: int) -> MLP:
    return MLP(layers, rngs=nnx.Rngs(0))  # same seed: every variant starts equal


def make_nnx_state(layers: int):
    model = make_model(layers)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    return (model, optimizer, *make_batch())


def model_params(model: MLP) -> dict[str, dict[str, jax.Array]]:
    return {
        f"l{i}": {"kernel": layer.kernel[...], "bias": layer.bias[...]}
        for i, layer in enumerate(model.layers)
    }


def params_of(state: State) -> dict[str, dict[str, jax.Array]]:
    """The parameters a variant holds now, as the floor's dict."""
    first = state[0]
    return model_params(first) if isinstance(first, nnx.Module) else first


# --------------------------------------------------------------------------
# Variants: each returns (call, state) for the generic timing loop
# --------------------------------------------------------------------------


def _stateful(step) -> Call:
    def call(state):
        return state, step(*state)

    return call


def variant_meshlift_jit(layers: int) -> tuple[Call, State]:
    """``ml.jit`` with graph semantics: updates written back onto the objects."""
    step = ml.jit(make_train_step("meshlift.jit"))
    return _stateful(step), make_nnx_state(layers)


def variant_nnx_jit(layers: int) -> tuple[Call, State]:
    """``nnx.jit`` default: graph mode with graph updates."""
    step = nnx.jit(make_train_step("nnx.jit"))
    return _stateful(step), make_nnx_state(layers)


def variant_nnx_jit_tree(layers: int) -> tuple[Call, State]:
    """``nnx.jit(graph=False)``: tree mode. In flax 0.12.8 it keeps the same
    calling convention (Variable updates are applied back after the call)."""
    step = nnx.jit(make_train_step("nnx.jit(graph=False)"), graph=False)
    return _stateful(step), make_nnx_state(layers)


def forward_arrays(params: dict[str, dict[str, jax.Array]], x: jax.Array, layers: int):
    """The MLP over the floor's dict of arrays."""
    for i in range(layers):
        layer = params[f"l{i}"]
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    return x


def variant_floor(layers: int) -> tuple[Call, State]:
    """Raw ``jax.jit`` over a dict of arrays and the optax state."""
    tx = optax.adam(LEARNING_RATE)
    params = model_params(make_model(layers))
    opt_state = tx.init(params)

    def train_step(params, opt_state, x, y):
        TRACES[FLOOR] += 1

        def loss_fn(params):
            return jnp.mean((forward_arrays(params, x, layers) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step)

    def call(state):
        params, opt_state, x, y = state
        params, opt_state, loss = step(params, opt_state, x, y)
        return (params, opt_state, x, y), loss

    return call, (params, opt_state, *make_batch())


def variant_meshlift_shard_map(layers: int) -> tuple[Call, State]:
    """``ml.shard_map``, data parallel on 8 devices, updates written back."""
    mesh = data_mesh(DATA_DEVICES)
    step = ml.shard_map(
        make_train_step("meshlift.shard_map", data_axis="data"),
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=P(),
    )
    model, optimizer, _, _ = make_nnx_state(layers)
    return _stateful(step), (model, optimizer, *shard_over_data(mesh, make_batch()))


def variant_shard_map_floor(layers: int) -> tuple[Call, State]:
    """Raw ``jax.shard_map`` under ``jax.jit``, the same data-parallel step over arrays."""
    mesh = data_mesh(DATA_DEVICES)
    tx = optax.adam(LEARNING_RATE)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(model_params(make_model(layers)), replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    def train_step(params, opt_state, x, y):
        TRACES[SHARD_MAP_FLOOR] += 1

        def loss_fn(params):
            loss = jnp.mean((forward_arrays(params, x, layers) - y) ** 2)
            return jax.lax.pmean(loss, "data")

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
        )
    )

    def call(state):
        params, opt_state, x, y = state
        params, opt_state, loss = step(params, opt_state, x, y)
        return (params, opt_state, x, y), loss

    return call, (params, opt_state, *shard_over_data(mesh, make_batch()))


VARIANTS: dict[str, Callable[[int], tuple[Call, State]]] = {
    "meshlift.jit": variant_meshlift_jit,
    "nnx.jit": variant_nnx_jit,
    "nnx.jit(graph=False)": variant_nnx_jit_tree,
    FLOOR: variant_floor,
    "meshlift.shard_map": variant_meshlift_shard_map,
    SHARD_MAP_FLOOR: variant_shard_map_floor,
}


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


@dataclass
class Run:
    """One variant at one depth while it is being measured."""

    name: str
    call: Call | None = None
    state: State = None
    k: int = 1
    losses: list[Any] = field(default_factory=list)  # floats (losses) or arrays (logits)
    params: list[np.ndarray] = field(default_factory=list)  # after warm-up
    samples_us: list[float] = field(default_factory=list)
    compile_s: float = 0.0
    traces: int = 0
    error: str | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def time_batch(call: Call, state: State, k: int, keep_gc: bool = False) -> tuple[State, float]:
    """Seconds per call over ``k`` calls, blocking on the last result only.

    Like ``timeit``: the garbage collector is off inside the batch unless
    ``keep_gc``.
    """
    gc_was_enabled = gc.isenabled()
    if not keep_gc:
        gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(k):
            state, out = call(state)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    return state, elapsed / k


Variants = Mapping[str, Callable[[int], tuple[Call, State]]]


def warm_up(
    run: Run,
    layers: int,
    target_s: float,
    max_k: int,
    variants: Variants = VARIANTS,
    params: Callable[[State], Any] = params_of,
) -> None:
    """Set up, compile, record the first results and choose ``k``.

    ``variants`` and ``params`` (a variant's state -> its parameters, as the
    floor's pytree) default to this script's; ``benchmarks/transformer.py``
    passes its own. A result is kept as a float if it is a scalar (a loss),
    else as an array (logits).
    """
    try:
        start = time.perf_counter()
        run.call, run.state = variants[run.name](layers)
        for _ in range(WARMUP_CALLS):
            run.state, loss = run.call(run.state)
            loss = np.asarray(loss)
            run.losses.append(float(loss) if loss.ndim == 0 else loss)
        run.params = [np.asarray(a) for a in jax.tree.leaves(params(run.state))]
        run.compile_s = time.perf_counter() - start
        # calibrate: size a batch to take about target_s
        single = min(time_batch(run.call, run.state, 1)[1] for _ in range(3))
        run.k = max(1, min(max_k, round(target_s / single)))
    except Exception as exc:  # one broken variant must not hide the others
        run.error = f"{type(exc).__name__}: {exc}"
        run.traceback = traceback.format_exc()
        run.call = run.state = None


def measure_depth(
    names: list[str],
    layers: int,
    rounds: int,
    target_s: float,
    max_k: int,
    log: Console,
    keep_gc: bool = False,
    variants: Variants = VARIANTS,
    params: Callable[[State], Any] = params_of,
) -> dict[str, Run]:
    runs = {name: Run(name) for name in names}
    for name in names:
        TRACES[name] = 0
    for run in runs.values():
        log.print(f"  L={layers:<4} compiling {run.name} ...", end="")
        warm_up(run, layers, target_s, max_k, variants, params)
        if run.ok:
            log.print(f" {run.compile_s:.1f}s, k={run.k}")
        else:
            log.print(" [red]FAILED[/]")
            log.print(run.traceback, markup=False, highlight=False)

    live = [run for run in runs.values() if run.ok]
    for r in range(rounds):
        order = random.Random(r).sample(live, len(live))  # no variant always follows another
        gc.collect()  # ~0.2 s with jax loaded: once per round, not per batch
        for run in order:
            try:
                run.state, per_call = time_batch(run.call, run.state, run.k, keep_gc=keep_gc)
            except Exception as exc:
                run.error = f"{type(exc).__name__}: {exc}"
                live.remove(run)
                continue
            run.samples_us.append(per_call * 1e6)
    for run in runs.values():  # free the 128-layer models before the next depth
        run.traces = TRACES[run.name]
        run.call = run.state = None
    return runs


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


def check_fresh_optimizer(name: str, layers: int = 4) -> dict[str, Any]:
    """Does a fresh ``nnx.Optimizer(model, optax.adam(...))`` force a retrace?

    ``optax.adam()`` returns new closures each time, so a cache key built on
    object identity (or on closure equality) retraces; DESIGN.md says it must
    not.
    """
    label = f"{name} [fresh optimizer]"
    TRACES[label] = 0
    try:
        jit = {
            "meshlift.jit": lambda f: ml.jit(f),
            "nnx.jit": lambda f: nnx.jit(f),
            "nnx.jit(graph=False)": lambda f: nnx.jit(f, graph=False),
        }[name]
        step = jit(make_train_step(label))
        model, optimizer, x, y = make_nnx_state(layers)
        step(model, optimizer, x, y)
        before = TRACES[label]
        fresh = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        jax.block_until_ready(step(model, fresh, x, y))
        after = TRACES[label]
        return {
            "traces_before": before,
            "traces_after": after,
            "retraced": after > before,
            "error": None,
        }
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return {
            "traces_before": None,
            "traces_after": None,
            "retraced": None,
            "error": f"{type(exc).__name__}: {exc}",
        }


def compare_to_floor(
    runs: dict[str, Run], baseline: Mapping[str, str] = BASELINE
) -> dict[str, str | None]:
    """Each variant's first losses, and its parameters after them, must match
    its floor's (same init, same data): this catches a step that does not
    write its updates back, or trains the wrong arrays. The floor is the one
    its time is divided by (``baseline``), the ``jax.jit floor`` unless named."""
    problems: dict[str, str | None] = {}
    for name, run in runs.items():
        floor = runs.get(baseline.get(name, FLOOR))
        if name == FLOOR or not run.ok or floor is None or not floor.ok:
            continue
        if not np.allclose(run.losses, floor.losses, rtol=1e-5, atol=1e-7):
            if np.ndim(floor.losses[0]) == 0:
                problems[name] = f"losses {run.losses} != floor {floor.losses}"
            else:  # arrays (logits; a shard_map variant's have a row per device)
                diff = np.max(np.abs(np.subtract(run.losses, floor.losses)))
                problems[name] = f"outputs differ from the floor's (max abs diff {diff:.3g})"
        elif len(run.params) != len(floor.params) or not all(
            np.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(run.params, floor.params, strict=True)
        ):
            worst = max(
                (
                    float(np.max(np.abs(a - b)))
                    for a, b in zip(run.params, floor.params, strict=False)
                    if a.shape == b.shape
                ),
                default=float("nan"),
            )
            problems[name] = (
                f"parameters after {WARMUP_CALLS} steps differ from the floor's "
                f"({len(run.params)} vs {len(floor.params)} arrays, "
                f"max abs diff {worst:.3g})"
            )
        else:
            problems[name] = None
    return problems


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def summarize(
    all_runs: dict[int, dict[str, Run]], baseline: Mapping[str, str] = BASELINE
) -> dict[str, Any]:
    """Per variant and depth: the median, and its ratio to the floor ``baseline`` names (the
    ``jax.jit floor`` unless named)."""
    results: dict[str, dict[str, Any]] = {}
    for layers, runs in all_runs.items():
        medians = {
            name: statistics.median(run.samples_us) if run.samples_us else None
            for name, run in runs.items()
        }
        for name, run in runs.items():
            floor = baseline.get(name, FLOOR)
            median, floor_us, floor_run = medians[name], medians.get(floor), runs.get(floor)
            results.setdefault(name, {})[str(layers)] = {
                "median_us": median,
                "floor": floor,
                "ratio_to_floor": (median / floor_us if median is not None and floor_us else None),
                "paired_ratio_to_floor": paired_ratio(run, floor_run),
                "min_us": min(run.samples_us) if run.samples_us else None,
                "samples_us": run.samples_us,
                "calls_per_sample": run.k,
                "compile_and_warmup_s": run.compile_s,
                "traces": run.traces if run.ok else None,
                "error": run.error,
            }
    return results


def paired_ratio(run: Run, floor: Run | None) -> float | None:
    """The median over rounds of the run's time over its floor's in the same round.

    Rounds interleave the variants, so the pair saw the same machine: a slow
    stretch (another tenant, a frequency change) slows both and cancels out,
    where the ratio of the two medians can take it in on one side only.
    """
    if floor is None or not run.samples_us or len(run.samples_us) != len(floor.samples_us):
        return None  # a variant that failed part way: its rounds no longer pair up
    return statistics.median(a / b for a, b in zip(run.samples_us, floor.samples_us, strict=True))


def print_table(console: Console, meta: dict[str, Any], results, checks) -> None:
    console.print(
        f"[bold]meshlift dispatch benchmark[/]  jax {meta['jax']}  "
        f"flax {meta['flax']}  optax {meta['optax']}  python {meta['python']}\n"
        f"devices: {meta['device_count']} x {meta['platform']}, "
        f"host cpus: {meta['cpu_count']}\n"
        f"XLA_FLAGS={meta['xla_flags']}\n"
        f"MLP width {WIDTH}, input (1, {WIDTH}), Adam; median over "
        f"{meta['rounds']} interleaved rounds, each ~{meta['target_ms']:.0f} ms "
        f"of back-to-back calls per variant "
        f"(gc {'on' if meta['gc_during_batches'] else 'off'} inside batches); "
        f"shard_map variants data parallel on {meta['shard_map_devices']} device(s)"
    )
    table = Table(title="train-step dispatch, µs per call (median)")
    table.add_column("variant")
    for layers in meta["layers"]:
        table.add_column(f"L={layers}", justify="right")
        table.add_column("vs floor", justify="right")
    for name in VARIANTS:
        if name not in results:
            continue
        row = [name]
        for layers in meta["layers"]:
            cell = results[name][str(layers)]
            if cell["median_us"] is None:
                row += ["[red]failed[/]", ""]
                continue
            row.append(f"{cell['median_us']:,.0f}")
            row.append(f"{cell['ratio_to_floor']:.2f}×")
        table.add_row(*row)
    console.print(table)
    for name, floor in BASELINE.items():
        console.print(f"{name}: vs {floor}; every other variant: vs {FLOOR}")
    paired = Table(title="vs floor, paired by round (median of time / floor's)")
    paired.add_column("variant")
    for layers in meta["layers"]:
        paired.add_column(f"L={layers}", justify="right")
    for name in VARIANTS:
        cells = [results.get(name, {}).get(str(layers), {}) for layers in meta["layers"]]
        ratios = [cell.get("paired_ratio_to_floor") for cell in cells]
        if name in results and any(r is not None for r in ratios):
            paired.add_row(name, *(f"{r:.2f}×" if r is not None else "" for r in ratios))
    console.print(paired)

    for name in results:
        for layers, cell in results[name].items():
            if cell["error"]:
                console.print(f"[red]{name} L={layers} failed:[/] {cell['error']}")
            elif cell["traces"] != 1:
                console.print(
                    f"[yellow]{name} traced {cell['traces']} times at L={layers} (expected 1)[/]"
                )
    for key, problem in checks["correctness"].items():
        mark = "[green]ok[/]" if problem is None else f"[red]MISMATCH[/] {problem}"
        console.print(f"losses and params after {WARMUP_CALLS} steps vs floor, {key}: {mark}")
    for name, check in checks["fresh_optimizer"].items():
        if check["error"]:
            verdict = f"[red]error[/] {check['error']}"
        elif check["retraced"]:
            verdict = (
                f"[red]RETRACED[/] (traces {check['traces_before']} -> {check['traces_after']})"
            )
        else:
            verdict = (
                f"[green]no retrace[/] (traces {check['traces_before']} -> {check['traces_after']})"
            )
        console.print(f"fresh nnx.Optimizer(model, optax.adam()), {name}: {verdict}")
    console.print(f"total time: {meta['total_s']:.0f} s")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--json, --gc and --shard-map-devices, which both benchmarks take."""
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON on stdout")
    parser.add_argument(
        "--gc",
        action="store_true",
        help="keep the garbage collector on while timing "
        "(default: off inside each batch, like timeit)",
    )
    parser.add_argument(
        "--shard-map-devices",
        type=int,
        default=DATA_DEVICES,
        help="size of the shard_map variants' data-parallel mesh (default %(default)s; "
        "1 isolates dispatch from the cost of executing on simulated devices)",
    )


def main(argv: list[str] | None = None) -> int:
    global DATA_DEVICES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument(
        "--repeats",
        type=float,
        default=1.0,
        help="scale the number of rounds and the batch length "
        "(1 = the default run, about 3 minutes on 2 cores; 0.2 = smoke test)",
    )
    add_output_options(parser)
    args = parser.parse_args(argv)
    DATA_DEVICES = args.shard_map_devices

    started = time.perf_counter()
    log = Console(stderr=True)
    rounds = max(3, round(61 * args.repeats))
    target_s = 0.05 * min(1.0, max(args.repeats, 0.25))
    max_k = 1000

    all_runs: dict[int, dict[str, Run]] = {}
    correctness: dict[str, str | None] = {}
    for layers in args.layers:
        runs = measure_depth(list(VARIANTS), layers, rounds, target_s, max_k, log, keep_gc=args.gc)
        all_runs[layers] = runs
        for name, problem in compare_to_floor(runs).items():
            correctness[f"{name} L={layers}"] = problem

    log.print("  checking retraces with a fresh optimizer ...")
    fresh = {
        name: check_fresh_optimizer(name)
        for name in ("meshlift.jit", "nnx.jit", "nnx.jit(graph=False)")
    }

    results = summarize(all_runs)
    meta = {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "device_count": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_count": os.cpu_count(),
        "layers": args.layers,
        "shard_map_devices": DATA_DEVICES,
        "rounds": rounds,
        "target_ms": target_s * 1e3,
        "gc_during_batches": args.gc,
        "total_s": time.perf_counter() - started,
    }
    checks = {"correctness": correctness, "fresh_optimizer": fresh}
    if args.json:
        print(json.dumps({"meta": meta, "results": results, "checks": checks}, indent=2))
    else:
        print_table(Console(), meta, results, checks)

    failed = (
        any(
            cell["error"] or cell["traces"] != 1
            for cells in results.values()
            for cell in cells.values()
        )
        or any(problem is not None for problem in correctness.values())
        or any(c["error"] or c["retraced"] for n, c in fresh.items() if n == "meshlift.jit")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
