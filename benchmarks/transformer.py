#!/usr/bin/env python
"""Dispatch, compile time and memory of a transformer-shaped model, meshlift against its baselines.

The model is a small decoder-only transformer: a token embedding tied with the
output projection, then ``L`` blocks of LayerNorm, causal self-attention (q, k,
v, o ``nnx.Linear`` projections), LayerNorm and a two-``Linear`` MLP, then a
final LayerNorm. Width 16, 2 heads, vocabulary 64, 8 tokens, so the device
work per array is tiny. Arrays: 33 at L=2 and 483 at L=32 for inference; with
the Adam state 101 at L=2, 371 at L=8, 1,451 at L=32.

Three parts, each against hand-written JAX:

* **dispatch** -- two steps, ``inference`` (``model(tokens)``, logits out,
  nothing written back) and ``train`` (forward, ``nnx.value_and_grad``, Adam
  through ``nnx.Optimizer``, written back), timed interleaved by
  ``benchmarks/dispatch.py``'s loop, for ``meshlift.jit``, ``nnx.jit``, the raw
  ``jax.jit floor`` (over the plain dict of arrays from ``nnx.split``, with
  ``nnx.merge`` inside the function, outputs fed back in), the ``jax.jit flat
  floor`` (the same over a flat list of the arrays: no dict to flatten per
  call, the tightest floor, and the one ``meshlift.jit`` is divided by),
  ``meshlift.shard_map`` and its ``jax.shard_map floor`` (data parallel on a
  1-D ``"data"`` mesh, of one device unless ``--shard-map-devices``);
* **compile** -- the first call of the train step (trace, lower, compile,
  run) under ``ml.jit`` and under ``jax.jit``, each on fresh objects after
  ``jax.clear_caches()``;
* **memory** -- ``memory_analysis()`` of a donated train step of a width-512
  model, ``ml.jit(..., donate_argnums=(0, 1))`` against the same step written
  by hand with ``nnx.split``/``nnx.merge`` under ``jax.jit(..., donate_argnums=(0, 1))``.

Run::

    python benchmarks/transformer.py                      # about 4 min on 2 cores
    python benchmarks/transformer.py --depths 2 8 32      # train at L=32 too: ~7 min
    python benchmarks/transformer.py --depths 2 --repeats 0.2   # quick smoke run
    python benchmarks/transformer.py --parts memory       # one part
    python benchmarks/transformer.py --parts dispatch --variants meshlift.jit   # and its floor
    python benchmarks/transformer.py --json               # numbers only, on stdout

See ``benchmarks/README.md`` for how to read the tables.
"""

from __future__ import annotations

import os

# Must happen before jax is imported (dispatch.py does the same).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import dispatch
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from dispatch import FLOOR, SHARD_MAP_FLOOR, TRACES, WARMUP_CALLS, Call, State
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import meshlift as ml

WIDTH, HEADS, VOCAB, SEQ = 16, 2, 64, 8
LEARNING_RATE = 1e-3
# The memory part's model: large enough that activations and Adam state matter.
MEMORY_MODEL = {"width": 512, "heads": 8, "vocab": 1024, "depth": 4}
MEMORY_BATCH = (8, 128)  # (batch, tokens)
# The shard_map variants' 1-D "data" mesh (--shard-map-devices); see dispatch.py.
DATA_DEVICES = 1
STEPS = ("inference", "train")
# The default depths keep the default run near 4 minutes on 2 cores: the train step's
# compile time grows with depth (~3,500 fusions at L=32), and on CPU its execution
# time, not dispatch, dominates a call from L=8 up (see benchmarks/README.md).
DEFAULT_DEPTHS = {"inference": [2, 8, 32], "train": [2, 8]}
MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
# The memory part's hand-written NNX step: jax.jit with nnx.split/merge by hand.
SPLIT_MERGE = "jax.jit split/merge"
SHORT = {SPLIT_MERGE: "split/merge"}  # column headings
# The tightest floor: jax.jit over a flat list of the same arrays (no dict to flatten per
# call), what any stateful wrapper must pay at least. meshlift.jit is measured against it.
FLAT_FLOOR = "jax.jit flat floor"
BASELINE = {**dispatch.BASELINE, "meshlift.jit": FLAT_FLOOR}


# --------------------------------------------------------------------------
# The model and the steps
# --------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-LayerNorm block: causal self-attention, then an MLP, each residual."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.q = nnx.Linear(width, width, rngs=rngs)
        # No key bias: it adds the same score to every key, which softmax cancels, so
        # its gradient is rounding noise that Adam scales up to ~lr-sized updates, and
        # two correct programs that round differently would end with different biases.
        self.k = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(width, width, rngs=rngs)
        self.o = nnx.Linear(width, width, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def attention(self, x):
        b, t, d = x.shape

        def heads(y):
            return y.reshape(b, t, self.heads, d // self.heads)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))

    def __call__(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    """Token embedding, ``depth`` blocks, LayerNorm, logits through the same embedding."""

    def __init__(
        self,
        depth: int,
        *,
        width: int = WIDTH,
        heads: int = HEADS,
        vocab: int = VOCAB,
        rngs: nnx.Rngs,
    ):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln_f(x))  # tied output projection


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_infer_step(name: str):
    """``model(tokens)``, counting its traces under ``name``."""

    def infer_step(model, tokens):
        TRACES[name] += 1
        return model(tokens)

    return infer_step


def make_train_step(name: str, data_axis: str | None = None):
    """The NNX train step; with ``data_axis`` the loss is ``pmean``'d over it."""

    def train_step(model, optimizer, tokens, targets):
        TRACES[name] += 1

        def loss_fn(model):
            loss = cross_entropy(model(tokens), targets)
            return jax.lax.pmean(loss, data_axis) if data_axis else loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def make_floor_infer_step(name: str, graphdef):
    """The floor's forward: ``nnx.merge`` of the dict of arrays, at trace time only."""

    def infer_step(params, tokens):
        TRACES[name] += 1
        return nnx.merge(graphdef, params)(tokens)

    return infer_step


def make_floor_train_step(name: str, graphdef, tx, data_axis: str | None = None):
    """``(params, opt_state, tokens, targets) -> (params, opt_state, loss)`` over arrays."""

    def train_step(params, opt_state, tokens, targets):
        TRACES[name] += 1

        def loss_fn(params):
            loss = cross_entropy(nnx.merge(graphdef, params)(tokens), targets)
            return jax.lax.pmean(loss, data_axis) if data_axis else loss

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_model(depth: int, **sizes: int) -> Transformer:
    return Transformer(depth, **sizes, rngs=nnx.Rngs(0))  # same seed: every variant starts equal


def make_batch(batch: int = 1, seq: int = SEQ, vocab: int = VOCAB):
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
    targets = jax.random.randint(jax.random.key(2), (batch, seq), 0, vocab)
    return tokens, targets


def floor_arrays(depth: int, **sizes: int):
    """The floor's graphdef and plain dict of parameter arrays (``nnx.split``)."""
    graphdef, state = nnx.split(make_model(depth, **sizes))
    return graphdef, state.to_pure_dict()


def params_of(state: State):
    """The parameters a variant holds now, as the floor's dict."""
    first = state[0]
    return nnx.state(first, nnx.Param).to_pure_dict() if isinstance(first, nnx.Module) else first


def array_counts(depth: int) -> dict[str, int]:
    model = make_model(depth)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    params = len(jax.tree.leaves(nnx.state(model)))
    return {"inference": params, "train": params + len(jax.tree.leaves(nnx.state(optimizer)))}


# --------------------------------------------------------------------------
# Variants: each returns (call, state) for dispatch.py's timing loop
# --------------------------------------------------------------------------


def _stateful(step) -> Call:
    def call(state):
        return state, step(*state)

    return call


def _nnx_train_state(depth: int, batch, **sizes: int) -> tuple:
    model = make_model(depth, **sizes)
    return (model, nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param), *batch)


def _floor_call(step) -> Call:
    def call(state):
        params, opt_state, tokens, targets = state
        params, opt_state, loss = step(params, opt_state, tokens, targets)
        return (params, opt_state, tokens, targets), loss

    return call


def infer_meshlift_jit(depth: int) -> tuple[Call, State]:
    step = ml.jit(make_infer_step("meshlift.jit"))
    return _stateful(step), (make_model(depth), make_batch()[0])


def infer_nnx_jit(depth: int) -> tuple[Call, State]:
    step = nnx.jit(make_infer_step("nnx.jit"))
    return _stateful(step), (make_model(depth), make_batch()[0])


def infer_floor(depth: int) -> tuple[Call, State]:
    graphdef, params = floor_arrays(depth)
    step = jax.jit(make_floor_infer_step(FLOOR, graphdef))
    return _stateful(step), (params, make_batch()[0])


def infer_flat_floor(depth: int) -> tuple[Call, State]:
    graphdef, params = floor_arrays(depth)
    leaves, treedef = jax.tree.flatten(params)
    infer_step = make_floor_infer_step(FLAT_FLOOR, graphdef)
    step = jax.jit(lambda leaves, tokens: infer_step(treedef.unflatten(leaves), tokens))
    return _stateful(step), (leaves, make_batch()[0])


def infer_meshlift_shard_map(depth: int) -> tuple[Call, State]:
    mesh = dispatch.data_mesh(DATA_DEVICES)
    step = ml.shard_map(
        make_infer_step("meshlift.shard_map"),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )
    return _stateful(step), (make_model(depth), dispatch.shard_over_data(mesh, make_batch())[0])


def infer_shard_map_floor(depth: int) -> tuple[Call, State]:
    mesh = dispatch.data_mesh(DATA_DEVICES)
    graphdef, params = floor_arrays(depth)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    step = jax.jit(
        jax.shard_map(
            make_floor_infer_step(SHARD_MAP_FLOOR, graphdef),
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
        )
    )
    return _stateful(step), (params, dispatch.shard_over_data(mesh, make_batch())[0])


def train_meshlift_jit(depth: int) -> tuple[Call, State]:
    step = ml.jit(make_train_step("meshlift.jit"))
    return _stateful(step), _nnx_train_state(depth, make_batch())


def train_nnx_jit(depth: int) -> tuple[Call, State]:
    step = nnx.jit(make_train_step("nnx.jit"))
    return _stateful(step), _nnx_train_state(depth, make_batch())


def train_floor(depth: int) -> tuple[Call, State]:
    tx = optax.adam(LEARNING_RATE)
    graphdef, params = floor_arrays(depth)
    step = jax.jit(make_floor_train_step(FLOOR, graphdef, tx))
    return _floor_call(step), (params, tx.init(params), *make_batch())


def train_flat_floor(depth: int) -> tuple[Call, State]:
    tx = optax.adam(LEARNING_RATE)
    graphdef, params = floor_arrays(depth)
    opt_state = tx.init(params)
    params_def, opt_def = jax.tree.structure(params), jax.tree.structure(opt_state)
    train_step = make_floor_train_step(FLAT_FLOOR, graphdef, tx)

    def flat_step(param_leaves, opt_leaves, tokens, targets):
        params, opt_state, loss = train_step(
            params_def.unflatten(param_leaves), opt_def.unflatten(opt_leaves), tokens, targets
        )
        return jax.tree.leaves(params), jax.tree.leaves(opt_state), loss

    state = (jax.tree.leaves(params), jax.tree.leaves(opt_state), *make_batch())
    return _floor_call(jax.jit(flat_step)), state


def train_meshlift_shard_map(depth: int) -> tuple[Call, State]:
    mesh = dispatch.data_mesh(DATA_DEVICES)
    step = ml.shard_map(
        make_train_step("meshlift.shard_map", data_axis="data"),
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=P(),
    )
    return _stateful(step), _nnx_train_state(depth, dispatch.shard_over_data(mesh, make_batch()))


def train_shard_map_floor(depth: int) -> tuple[Call, State]:
    mesh = dispatch.data_mesh(DATA_DEVICES)
    tx = optax.adam(LEARNING_RATE)
    graphdef, params = floor_arrays(depth)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    step = jax.jit(
        jax.shard_map(
            make_floor_train_step(SHARD_MAP_FLOOR, graphdef, tx, data_axis="data"),
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
        )
    )
    return _floor_call(step), (params, opt_state, *dispatch.shard_over_data(mesh, make_batch()))


VARIANTS: dict[str, dict[str, Callable[[int], tuple[Call, State]]]] = {
    "inference": {
        "meshlift.jit": infer_meshlift_jit,
        "nnx.jit": infer_nnx_jit,
        FLOOR: infer_floor,
        FLAT_FLOOR: infer_flat_floor,
        "meshlift.shard_map": infer_meshlift_shard_map,
        SHARD_MAP_FLOOR: infer_shard_map_floor,
    },
    "train": {
        "meshlift.jit": train_meshlift_jit,
        "nnx.jit": train_nnx_jit,
        FLOOR: train_floor,
        FLAT_FLOOR: train_flat_floor,
        "meshlift.shard_map": train_meshlift_shard_map,
        SHARD_MAP_FLOOR: train_shard_map_floor,
    },
}


# --------------------------------------------------------------------------
# Compile time: the first call on fresh objects, caches cleared
# --------------------------------------------------------------------------


def first_call_s(name: str, depth: int) -> tuple[float, int]:
    """Seconds for the first call of a fresh train step (trace, lower, compile,
    run), after ``jax.clear_caches()``; and the number of traces it took."""
    label = f"{name} [first call]"
    TRACES[label] = 0
    if name == "meshlift.jit":
        step = ml.jit(make_train_step(label))
        args = _nnx_train_state(depth, make_batch())
    else:
        tx = optax.adam(LEARNING_RATE)
        graphdef, params = floor_arrays(depth)
        step = jax.jit(make_floor_train_step(label, graphdef, tx))
        args = (params, tx.init(params), *make_batch())
    jax.block_until_ready(jax.tree.leaves(nnx.state(args)))  # building them is not timed
    jax.clear_caches()  # after building: they need eager ops compiled
    gc.collect()
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start, TRACES[label]


def measure_compile(depth: int, repeats: int, log: Console) -> dict[str, Any]:
    names = ("meshlift.jit", FLOOR)
    samples: dict[str, list[float]] = {name: [] for name in names}
    traces: dict[str, list[int]] = {name: [] for name in names}
    try:
        for name in names:  # discarded: the first compile in a process pays one-off costs
            first_call_s(name, min(depth, 2))
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                seconds, count = first_call_s(name, depth)
                samples[name].append(seconds)
                traces[name].append(count)
                log.print(f"  compile L={depth} {name}: {seconds:.2f}s")
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return {"depth": depth, "error": f"{type(exc).__name__}: {exc}"}
    medians = {name: statistics.median(s) for name, s in samples.items()}
    return {
        "depth": depth,
        "error": None,
        "samples_s": samples,
        "traces": traces,
        "median_s": medians,
        "ratio": medians["meshlift.jit"] / medians[FLOOR],
    }


# --------------------------------------------------------------------------
# Memory: a donated train step, lowered and compiled by each
# --------------------------------------------------------------------------


def make_split_merge_train_step(name: str, model_graphdef, opt_graphdef):
    """The NNX train step under raw ``jax.jit`` by hand: ``nnx.merge`` of the model's
    and the optimizer's states in, ``nnx.state`` of both out: what a user writes
    by hand. Its arrays are exactly ``meshlift.jit``'s (the ``jax.jit floor``'s
    lack ``nnx.Optimizer``'s step count, so its sizes differ by a few bytes)."""
    train_step = make_train_step(name)

    def step(model_state, opt_state, tokens, targets):
        model = nnx.merge(model_graphdef, model_state)
        optimizer = nnx.merge(opt_graphdef, opt_state)
        loss = train_step(model, optimizer, tokens, targets)
        return nnx.state(model), nnx.state(optimizer), loss

    return step


def memory_stats(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    out = {f: int(getattr(stats, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
    # CompiledMemoryStats has no peak field: live at once are the arguments, the
    # outputs that do not reuse a donated argument's buffer, and the temporaries.
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def donated_steps(depth: int, sizes: dict[str, int]) -> dict[str, Callable[[], tuple]]:
    """Each memory variant: a builder of (step with donate_argnums=(0, 1), arguments)."""
    batch = make_batch(*MEMORY_BATCH, vocab=sizes["vocab"])

    def meshlift_jit():
        step = ml.jit(make_train_step("meshlift.jit [donated]"), donate_argnums=(0, 1))
        return step, _nnx_train_state(depth, batch, **sizes)

    def split_merge():
        model, optimizer, *_ = _nnx_train_state(depth, batch, **sizes)
        (model_graphdef, model_state), (opt_graphdef, opt_state) = (
            nnx.split(model),
            nnx.split(optimizer),
        )
        step = make_split_merge_train_step(SPLIT_MERGE, model_graphdef, opt_graphdef)
        return jax.jit(step, donate_argnums=(0, 1)), (model_state, opt_state, *batch)

    return {"meshlift.jit": meshlift_jit, SPLIT_MERGE: split_merge}


def measure_memory(log: Console) -> dict[str, Any]:
    """``.lower(...).compile().memory_analysis()`` of each donated step, and
    whether a call frees the donated inputs. meshlift's ``Compiled`` forwards
    ``memory_analysis`` to JAX's."""
    sizes = {k: v for k, v in MEMORY_MODEL.items() if k != "depth"}
    depth = MEMORY_MODEL["depth"]
    result: dict[str, Any] = {
        "model": MEMORY_MODEL,
        "batch": MEMORY_BATCH,
        "stats": {},
        "donated": {},
        "error": None,
    }
    try:
        for name, build in donated_steps(depth, sizes).items():
            log.print(f"  memory: compiling {name}, width {sizes['width']} ...")
            step, args = build()
            result.setdefault("params", sum(a.size for a in jax.tree.leaves(nnx.state(args[0]))))
            compiled = step.lower(*args).compile()
            result["stats"][name] = memory_stats(compiled)
            first = jax.tree.leaves(nnx.state(args[0]))[0]
            jax.block_until_ready(compiled(*args))
            result["donated"][name] = first.is_deleted()
            del step, args, compiled, first
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def chosen(step: str, names: list[str] | None) -> list[str]:
    """The variants of `step` to time: `names` and the floors they are divided by, or all."""
    if names is None:
        return list(VARIANTS[step])
    wanted = {*names, *(BASELINE.get(name, FLOOR) for name in names)}
    return [name for name in VARIANTS[step] if name in wanted]


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def print_report(console: Console, meta, results, checks, compile_, memory) -> None:
    console.print(
        f"[bold]meshlift transformer benchmark[/]  jax {meta['jax']}  "
        f"flax {meta['flax']}  optax {meta['optax']}  python {meta['python']}\n"
        f"devices: {meta['device_count']} x {meta['platform']}, "
        f"host cpus: {meta['cpu_count']}\n"
        f"XLA_FLAGS={meta['xla_flags']}"
    )
    if results:
        print_dispatch(console, meta, results, checks)
    if compile_ is not None:
        if compile_["error"]:
            console.print(f"[red]compile time failed:[/] {compile_['error']}")
        else:
            print_compile(console, compile_)
    if memory is not None:
        if memory["error"]:
            console.print(f"[red]memory failed:[/] {memory['error']}")
        else:
            print_memory(console, memory)
    parts = ", ".join(f"{part} {seconds:.0f} s" for part, seconds in meta["part_s"].items())
    console.print(f"total time: {meta['total_s']:.0f} s ({parts})")


def print_dispatch(console: Console, meta, results, checks) -> None:
    console.print(
        f"transformer width {WIDTH}, {HEADS} heads, vocab {VOCAB}, tokens (1, {SEQ}), "
        f"Adam; median over {meta['rounds']} interleaved rounds, each "
        f"~{meta['target_ms']:.0f} ms of back-to-back calls per variant "
        f"(gc {'on' if meta['gc_during_batches'] else 'off'} inside batches); "
        f"shard_map variants data parallel on {meta['shard_map_devices']} device(s)"
    )
    counts = meta["array_counts"]
    for step in meta["steps"]:
        table = Table(title=f"{step} step, µs per call (median)", show_edge=False)
        table.add_column("variant", no_wrap=True)
        depths = meta["depths"][step]
        for depth in depths:
            table.add_column(f"L={depth}", justify="right")
            table.add_column("vs floor", justify="right")
        table.add_row(
            "[dim]arrays[/]",
            *(x for d in depths for x in (f"[dim]{counts[str(d)][step]:,}[/]", "")),
            end_section=True,
        )
        for name in results[step]:
            row = [name]
            for depth in depths:
                cell = results[step][name][str(depth)]
                if cell["median_us"] is None:
                    row += ["[red]failed[/]", ""]
                    continue
                ratio = cell["ratio_to_floor"]  # None: its floor was not timed (--variants)
                row.append(f"{cell['median_us']:,.0f}")
                row.append("" if ratio is None else f"{ratio:.2f}×")
            table.add_row(*row)
        console.print(table)
    console.print(
        "arrays: the model's Variables (inference), and the optimizer's too (train). "
        + "; ".join(f"{name}: vs {floor}" for name, floor in BASELINE.items())
        + f"; every other variant: vs {FLOOR}"
    )
    for step, by_name in results.items():
        for name, cells in by_name.items():
            for depth, cell in cells.items():
                if cell["error"]:
                    console.print(f"[red]{step} {name} L={depth} failed:[/] {cell['error']}")
                elif cell["traces"] != 1:
                    console.print(
                        f"[yellow]{step} {name} traced {cell['traces']} times at L={depth} "
                        f"(expected 1)[/]"
                    )
    for key, problems in checks["correctness"].items():
        bad = {name: problem for name, problem in problems.items() if problem is not None}
        mark = "[green]ok[/]" if not bad else "[red]MISMATCH[/]"
        console.print(
            f"outputs and params after {WARMUP_CALLS} calls vs floor, {key}: {mark}"
            + "".join(f"\n  {name}: {problem}" for name, problem in bad.items())
        )


def print_compile(console: Console, compile_: dict[str, Any]) -> None:
    samples = compile_["samples_s"]
    table = Table(
        title=f"train step, first call (trace, lower, compile, run), L={compile_['depth']}, "
        f"s, median of {len(samples[FLOOR])}"
    )
    for column in ("variant", "median", "min", "max", "vs floor", "traces"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, times in samples.items():
        median = compile_["median_s"][name]
        table.add_row(
            name,
            f"{median:.2f}",
            f"{min(times):.2f}",
            f"{max(times):.2f}",
            f"{median / compile_['median_s'][FLOOR]:.2f}×",
            ",".join(map(str, sorted(set(compile_["traces"][name])))),
        )
    console.print(table)


def print_memory(console: Console, memory: dict[str, Any]) -> None:
    model, stats = memory["model"], memory["stats"]
    table = Table(
        title=f"donated train step, memory_analysis(), MiB: width {model['width']}, "
        f"depth {model['depth']}, vocab {model['vocab']}, tokens {memory['batch']}, "
        f"{memory['params']:,} parameters"
    )
    table.add_column("field")
    for name in stats:
        table.add_column(SHORT.get(name, name), justify="right")
    table.add_column("diff", justify="right")
    for f in (*MEMORY_FIELDS, "peak"):
        diff = stats["meshlift.jit"][f] - stats[SPLIT_MERGE][f]
        mark = "[green]0[/]" if diff == 0 else f"{'[red]' if diff > 0 else ''}{diff:+,} B"
        table.add_row(f, *(mib(s[f]) for s in stats.values()), mark)
    table.add_row(
        "inputs freed", *("yes" if d else "[red]no[/]" for d in memory["donated"].values())
    )
    console.print(table)
    diff = stats["meshlift.jit"]["peak"] - stats[SPLIT_MERGE]["peak"]
    verdict = (
        "[green]equal to[/]"
        if diff == 0
        else f"[red]{diff:,} B above[/]"
        if diff > 0
        else f"{-diff:,} B below"
    )
    console.print(
        f"peak (argument + output - alias + temp; the fields give no peak): meshlift.jit is "
        f"{verdict} the hand-written step's ({SPLIT_MERGE}: nnx.split/merge by hand, the "
        f"same arrays). Both donate_argnums=(0, 1); diff: meshlift.jit - split/merge; "
        f"inputs freed: a call deleted the donated arrays."
    )


def main(argv: list[str] | None = None) -> int:
    global DATA_DEVICES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--depths",
        type=int,
        nargs="+",
        help="the model depths, for both steps (default: inference "
        + ", ".join(map(str, DEFAULT_DEPTHS["inference"]))
        + "; train "
        + ", ".join(map(str, DEFAULT_DEPTHS["train"]))
        + "). --depths 2 8 32 takes about 7 minutes on 2 cores",
    )
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS["train"]),
        help="time only these (and the floors they are divided by); default: all. "
        "--variants meshlift.jit times it against the flat floor alone, in paired rounds",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("dispatch", "compile", "memory"),
        default=["dispatch", "compile", "memory"],
    )
    parser.add_argument(
        "--repeats",
        type=float,
        default=1.0,
        help="scale the number of rounds, the batch length and the compile repeats "
        "(1 = the default run, about 4 minutes on 2 cores; 0.2 = smoke test)",
    )
    parser.add_argument(
        "--compile-depth",
        type=int,
        default=2,
        help="depth of the model whose first call is timed (default %(default)s)",
    )
    dispatch.add_output_options(parser)
    args = parser.parse_args(argv)
    DATA_DEVICES = args.shard_map_devices

    started = time.perf_counter()
    log = Console(stderr=True)
    depths = {step: args.depths or DEFAULT_DEPTHS[step] for step in args.steps}
    rounds = max(3, round(25 * args.repeats))
    target_s = 0.04 * min(1.0, max(args.repeats, 0.25))
    max_k = 1000

    results: dict[str, dict[str, Any]] = {}
    correctness: dict[str, dict[str, str | None]] = {}
    part_s: dict[str, float] = {}
    if "dispatch" in args.parts:
        for step in args.steps:
            all_runs = {}
            for depth in depths[step]:
                log.print(f"  {step} step, {rounds} rounds:")
                runs = dispatch.measure_depth(
                    chosen(step, args.variants),
                    depth,
                    rounds,
                    target_s,
                    max_k,
                    log,
                    keep_gc=args.gc,
                    variants=VARIANTS[step],
                    params=params_of,
                )
                all_runs[depth] = runs
                correctness[f"{step} L={depth}"] = dispatch.compare_to_floor(runs, BASELINE)
            results[step] = dispatch.summarize(all_runs, BASELINE)
        part_s["dispatch"] = time.perf_counter() - started

    compile_ = memory = None
    if "compile" in args.parts:
        start = time.perf_counter()
        compile_ = measure_compile(args.compile_depth, max(1, round(3 * args.repeats)), log)
        part_s["compile"] = time.perf_counter() - start
    if "memory" in args.parts:
        start = time.perf_counter()
        memory = measure_memory(log)
        part_s["memory"] = time.perf_counter() - start

    meta = {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "device_count": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_count": os.cpu_count(),
        "depths": depths,
        "steps": args.steps,
        "array_counts": {str(d): array_counts(d) for d in sorted(set().union(*depths.values()))},
        "shard_map_devices": DATA_DEVICES,
        "rounds": rounds,
        "target_ms": target_s * 1e3,
        "gc_during_batches": args.gc,
        "part_s": part_s,
        "total_s": time.perf_counter() - started,
    }
    checks = {"correctness": correctness}
    if args.json:
        print(
            json.dumps(
                {
                    "meta": meta,
                    "results": results,
                    "checks": checks,
                    "compile": compile_,
                    "memory": memory,
                },
                indent=2,
            )
        )
    else:
        print_report(Console(), meta, results, checks, compile_, memory)

    failed = (
        any(
            cell["error"] or cell["traces"] != 1
            for by_name in results.values()
            for cells in by_name.values()
            for cell in cells.values()
        )
        or any(p is not None for problems in correctness.values() for p in problems.values())
        or (compile_ is not None and compile_["error"] is not None)
        or (memory is not None and memory["error"] is not None)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
