"""`meshlift demo`: one transformer, one plan, every installed backend, the same result.

A small character-level transformer language model trains on a text shipped
with meshlift (`meshlift/data/demo_text.txt`), on 8 simulated CPU devices
arranged as a `data` × `model` mesh. It trains once per installed backend
(`ml.backends()`), from the same initial parameters on the same batches:

every backend with the same tensor-parallel plan: attention heads, the MLP
and the vocabulary split over `model`, the batch over `data`. Backends that
partition automatically (`jit`, `pjit`: capability `auto-partitioning`) run
the global train step; backends that run per-shard code (`shard_map`:
capability `manual-collectives`) are manual over `data` only
(`axis_names={"data"}`), so the compiler keeps the plan's `model` split, and
run the same step on one shard of the batch, the loss averaged over `data`
by `jax.lax.pmean` inside the differentiated function.

It first prints a line saying what it is about to run; while it trains, a
progress bar per backend in a terminal (its status reads "compiling…" until the
first step returns), or, piped, one line per backend as it finishes. Then it
prints, per backend, the loss (cross-entropy, in nats) at the first and last
steps, the largest difference of any parameter from the `jit` backend's, the
median step time and the parameter bytes per device (in the units of the next
table), and `ml.explain`'s table of the plan; last, a sample of text
the trained model writes, decoded greedily from a prompt by the same lifted
model (`generate`). It exits with status 1 if any backend's parameters differ
from `jit`'s by more than 1e-5.

Read it top to bottom as example code:

```sh
meshlift demo
meshlift demo --steps 60 --mesh data=4,model=2 --backends jit,shard_map --json
meshlift demo --sample 100     # a longer sample of generated text at the end
```
"""

from __future__ import annotations

import os

# Simulate 8 CPU devices (on any machine, GPUs included: the demo is about the mesh, not
# speed). XLA reads these when JAX first creates its devices, so they must be set before
# anything touches them; main() raises the count for a larger --mesh, checks that it was in
# time and says why if not. A count the user set is left alone.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    _USER_DEVICE_COUNT = False
else:
    _USER_DEVICE_COUNT = True
if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import importlib.resources
import json
import math
import re
import statistics
import sys
import time
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.tools.demo_display import (
    Progress,
    disagreement,
    make_progress,
    mesh_str,
    print_tables,
)

DEVICES = 8  # simulated CPU devices, unless a --mesh needs more (or the user chose a count)
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
VOCAB = 128  # bytes of ASCII text
EMBED, HEADS, MLP, LAYERS = 64, 8, 256, 2
SEQ, BATCH = 32, 16
LEARNING_RATE = 1e-2
TOLERANCE = 1e-5  # max |Δparameter| allowed against the reference backend
PROMPT = "The lighthouse stood at the end "  # the sample's prompt: SEQ characters of the text
SAMPLE = 48  # characters generated after the prompt, by default


# -- the model ------------------------------------------------------------------------------
# No biases anywhere: a bias whose true gradient is zero (a key bias in attention, a bias
# right before a norm) gets a gradient of pure float32 rounding, which differs with each
# backend's reduction order; plain weights keep the backends in step to 1e-5.
class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(EMBED, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=EMBED, use_bias=False, decode=False, rngs=rngs
        )
        self.norm2 = nnx.RMSNorm(EMBED, rngs=rngs)
        self.up = nnx.Linear(EMBED, MLP, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, use_bias=False, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class CharTransformer(nnx.Module):
    """Characters in, next-character logits out; the output projection is the embedding."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.position = nnx.Embed(SEQ, EMBED, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(EMBED, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))  # tied output projection


# -- the plans ------------------------------------------------------------------------------
# Megatron-style tensor parallelism: query/key/value split by heads (columns), the
# attention output and the MLP's down projection by rows, the MLP's up projection by
# columns, the (tied) embedding by vocabulary. The optimizer's state follows the same plan,
# because its paths end with the parameters' paths.
TENSOR_PARALLEL = ml.StateSharding(
    {
        ml.path_endswith("query", "kernel"): P(None, "model", None),
        ml.path_endswith("key", "kernel"): P(None, "model", None),
        ml.path_endswith("value", "kernel"): P(None, "model", None),
        ml.path_endswith("out", "kernel"): P("model", None, None),
        ml.path_endswith("up", "kernel"): P(None, "model"),
        ml.path_endswith("down", "kernel"): P("model", None),
        ml.path_endswith("embed", "embedding"): P("model", None),
        ...: P(),  # norms and positions: replicated
    }
)
# Per-shard backends are manual over 'data' alone: 'model' stays the compiler's, so the code
# inside sees whole parameters and the same plan holds (no psums inside the model).
MANUAL_AXES: dict[str, Any] = {"axis_names": {"data"}}


def loss_fn(model: CharTransformer, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_train_step(data_axis: str | None):
    """The train step; with `data_axis` it runs on one shard of the batch (shard_map).

    On a shard, the loss is averaged over `data_axis` inside the differentiated
    function, so its gradient is the global gradient. (Averaging the gradients
    afterwards would double count under shard_map's check_vma=True, which already
    sums the gradients of replicated parameters over the axis.)
    """

    def global_loss(model, tokens, targets):
        loss = loss_fn(model, tokens, targets)
        return loss if data_axis is None else jax.lax.pmean(loss, data_axis)

    def train_step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(global_loss)(model, tokens, targets)
        optimizer.update(model, grads)  # updates land on the caller's model and optimizer
        return loss

    return train_step


def make_state(seed: int) -> tuple[CharTransformer, nnx.Optimizer]:
    model = CharTransformer(nnx.Rngs(seed))
    # Adam divides by |g| + eps: with the default eps=1e-8, float32 rounding in tiny
    # gradients is amplified to whole learning-rate steps. eps=1e-3 bounds that.
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE, eps=1e-3), wrt=nnx.Param)
    return model, optimizer


# -- the data -------------------------------------------------------------------------------
def load_text() -> np.ndarray:
    """The bundled text as bytes (its characters are ASCII, so each is one token < 128)."""
    data = importlib.resources.files("meshlift").joinpath("data", "demo_text.txt").read_bytes()
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32) % VOCAB


def make_batches(seed: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps` batches of (tokens, next tokens) at random places in the text."""
    text = load_text()
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        starts = rng.integers(0, len(text) - SEQ - 1, size=BATCH)
        window = np.stack([text[s : s + SEQ + 1] for s in starts])
        batches.append((window[:, :-1], window[:, 1:]))
    return batches


# -- training under one backend -------------------------------------------------------------
def train(
    backend: ml.Backend,
    mesh: jax.sharding.Mesh,
    seed: int,
    batches: list[tuple[np.ndarray, np.ndarray]],
    progress: Progress,
) -> tuple[CharTransformer, dict[str, Any], dict[str, np.ndarray]]:
    """Train with one backend; returns the model, its results and its parameters by path."""
    manual = "manual-collectives" in backend.capabilities
    plan = TENSOR_PARALLEL  # one plan for every backend
    model, optimizer = make_state(seed)  # the same initial parameters for every backend
    step = ml.transform(
        backend,
        make_train_step("data" if manual else None),
        mesh=mesh,
        in_specs=(plan, plan, P("data"), P("data")),  # model, optimizer, tokens, targets
        out_specs=P(),
        **(MANUAL_AXES if manual else {}),
    )
    progress.start(backend.name, len(batches))
    losses, seconds = [], []
    with ml.use_mesh(mesh):  # pjit takes the mesh from the call site
        for tokens, targets in batches:
            start = time.perf_counter()
            losses.append(float(step(model, optimizer, tokens, targets)))
            seconds.append(time.perf_counter() - start)
            progress.step(losses[-1])
    params = parameter_rows(model, plan, mesh)
    arrays = {_dotted(path): np.asarray(p.get_value()) for path, p in _flat_params(model)}
    result = {
        "backend": backend.name,
        "capabilities": sorted(backend.capabilities),
        "plan": "tensor-parallel, manual over data" if manual else "tensor-parallel",
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "losses": losses,
        "first_step_s": round(seconds[0], 4),  # tracing and compiling
        "median_step_ms": round(1e3 * statistics.median(seconds[1:] or seconds), 3),
        "param_bytes_per_device": sum(row["bytes_per_device"] for row in params),
        "params": params,
    }
    progress.finish(result)
    return model, result, arrays


def _flat_params(model: nnx.Module) -> list[tuple[tuple, nnx.Param]]:
    return list(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def generate(
    backend: ml.Backend, mesh: jax.sharding.Mesh, model: CharTransformer, prompt: str, length: int
) -> str:
    """Greedy decoding: the `length` characters the model finds likeliest after `prompt`.

    One lifted forward pass, on the same backend and plan the model trained with,
    gives the next character; the model always sees the last SEQ characters
    (padded on the left with spaces), one shape, so it compiles once.
    """
    manual = "manual-collectives" in backend.capabilities
    next_token = ml.transform(
        backend,
        lambda model, window: jnp.argmax(model(window)[:, -1], axis=-1),
        mesh=mesh,
        in_specs=(TENSOR_PARALLEL, P()),  # the model as it trained; one window on every device
        out_specs=P(),
        **(MANUAL_AXES if manual else {}),
    )
    text = prompt
    with ml.use_mesh(mesh):
        for _ in range(length):
            window = text[-SEQ:].rjust(SEQ).encode("ascii", errors="replace")
            tokens = np.frombuffer(window, dtype=np.uint8).astype(np.int32)[None] % VOCAB
            text += chr(int(next_token(model, tokens)[0]))
    return text[len(prompt) :]


def parameter_rows(
    model: nnx.Module, plan: ml.StateSharding, mesh: jax.sharding.Mesh
) -> list[dict[str, Any]]:
    """Each parameter: path, shape, the spec its array has, and whether that is the plan's."""
    rows = []
    for path, param in _flat_params(model):
        array = param.get_value()
        spec = cast(P, plan.spec_for(path, param))  # the demo's plans give a spec for all
        planned = NamedSharding(mesh, spec)
        rows.append(
            {
                "path": _dotted(path),
                "shape": list(array.shape),
                "spec": [list(e) if isinstance(e, tuple) else e for e in array.sharding.spec],
                "matches_plan": array.sharding.is_equivalent_to(planned, array.ndim),
                "bytes_per_device": math.prod(array.sharding.shard_shape(array.shape))
                * array.dtype.itemsize,
            }
        )
    return rows


def run(
    backend_names: list[str],
    mesh_axes: dict[str, int],
    steps: int,
    seed: int,
    show: bool,
    sample: int = SAMPLE,
) -> tuple[dict[str, Any], ml.Explanation]:
    """Train with each backend in turn; the results as plain data, and the plan explained.

    Then the reference backend's model writes `sample` characters after `PROMPT`.
    """
    progress = make_progress(show)
    progress.header(backend_names, mesh_axes, steps)
    mesh = ml.make_mesh(mesh_axes, devices=jax.devices()[: math.prod(mesh_axes.values())])
    batches = make_batches(seed, steps)
    with progress:
        runs = [
            train(ml.get_backend(name), mesh, seed, batches, progress) for name in backend_names
        ]
    reference = "jit" if "jit" in backend_names else backend_names[0]
    ref_model, _, ref = runs[backend_names.index(reference)]
    results = []
    for _, r, arrays in runs:
        r["max_abs_diff"] = max(float(np.max(np.abs(arrays[p] - ref[p]))) for p in ref)
        results.append(r)
    explanation = ml.explain(nnx.eval_shape(lambda: make_state(seed)[0]), TENSOR_PARALLEL, mesh)
    text = generate(ml.get_backend(reference), mesh, ref_model, PROMPT, sample) if sample else None
    return {
        "mesh": dict(mesh.shape),
        "steps": steps,
        "seed": seed,
        "reference": reference,
        "tolerance": TOLERANCE,
        "agree": all(r["max_abs_diff"] <= TOLERANCE for r in results),
        "backends": results,
        "plan": explanation.to_dict(),
        "sample": None
        if text is None
        else {"backend": reference, "prompt": PROMPT, "text": text, "decoding": "greedy"},
    }, explanation


def _simulate_devices(needed: int) -> None:
    """Ask XLA for `needed` simulated CPU devices when a mesh needs more than the demo's 8.

    As `meshlift plan` does: a count the user set is left alone, and the flag takes effect
    only if JAX has not created its devices yet in this process (`_too_few_devices` says why
    when it had).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if not _USER_DEVICE_COUNT and needed > DEVICES:
        os.environ["XLA_FLAGS"] = re.sub(
            rf"{DEVICE_COUNT_FLAG}=\d+", f"{DEVICE_COUNT_FLAG}={needed}", flags
        )


def _too_few_devices(mesh: dict[str, int], needed: int, available: int) -> str:
    platform = jax.default_backend()
    flags = os.environ.get("XLA_FLAGS", "")
    smaller = f"or pass a --mesh whose sizes multiply to at most {available}"
    if platform != "cpu":
        why = (
            f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r} chooses them, and the "
            f"demo simulates CPU devices only when JAX_PLATFORMS is unset. Unset it, {smaller}"
        )
    elif _USER_DEVICE_COUNT:
        why = (
            f"XLA_FLAGS ({flags!r}) sets the count, and the demo leaves a count you set "
            f"alone. Unset it (the demo then asks for {needed}), {smaller}"
        )
    else:
        why = (
            f"JAX had already created its devices in this process before the demo could ask "
            f"for {needed} simulated CPU devices (XLA reads "
            f"XLA_FLAGS={DEVICE_COUNT_FLAG} only then). Run the demo in a fresh process "
            f"(`meshlift demo`), {smaller}"
        )
    return (
        f"meshlift demo: the mesh {mesh_str(mesh)} needs {needed} devices, but JAX has "
        f"{available} {platform} device(s): {why}."
    )


# -- command line ---------------------------------------------------------------------------
def _mesh_arg(text: str) -> dict[str, int]:
    try:
        axes = {name.strip(): int(size) for name, size in (p.split("=") for p in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE,NAME=SIZE, got {text!r}") from None
    if set(axes) != {"data", "model"} or min(axes.values()) < 1:
        raise argparse.ArgumentTypeError(
            f"need positive sizes for axes 'data' and 'model', e.g. data=2,model=4; got {text!r}"
        )
    if BATCH % axes["data"] or HEADS % axes["model"]:
        raise argparse.ArgumentTypeError(
            f"'data' must divide the batch ({BATCH}) and 'model' the number of attention "
            f"heads ({HEADS}); got {text!r}"
        )
    return axes


def _backends_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    installed = sorted(b.name for b in ml.backends())
    unknown = [n for n in names if n not in installed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"not installed: {', '.join(unknown) or '(none given)'}; installed backends are "
            f"{', '.join(installed)} (see `meshlift backends`)"
        )
    return list(dict.fromkeys(names))


def _default_backends() -> list[str]:
    names = sorted(b.name for b in ml.backends())
    return sorted(names, key=lambda n: n != "jit")  # the reference first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="meshlift demo",
        description=(
            "Train a small character-level transformer on a bundled text, on 8 simulated CPU "
            "devices, once with every installed backend, and check that they all end with the "
            f"same parameters (to {TOLERANCE:g}). Exits 1 if they do not."
        ),
        epilog="""examples:
  meshlift demo
      100 steps under every installed backend on a data=2 x model=4 mesh, then the
      tables and a sample of generated text
  meshlift demo --steps 60 --mesh data=4,model=2 --backends jit,shard_map
      fewer steps, another mesh, two backends
  meshlift demo --seed 3 --sample 100
      other initial parameters and batches; a longer sample at the end (--sample 0: none)
  meshlift demo --json | jq '.backends[] | {backend, final_loss}'
      the results as JSON: losses, step times, the plan, the sample""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    parser.add_argument(
        "--mesh",
        type=_mesh_arg,
        default={"data": 2, "model": 4},
        help="mesh axes (default: data=2,model=4)",
    )
    parser.add_argument(
        "--backends",
        type=_backends_arg,
        default=None,
        help="comma-separated backends to run (default: every installed one, jit first)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for the parameters and batches (default: 0)"
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=SAMPLE,
        metavar="N",
        help=f"characters of text to generate after training (default: {SAMPLE}; 0: none)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.sample < 0:
        parser.error("--sample must be at least 0")
    backends = args.backends or _default_backends()
    if not backends:
        print(
            "meshlift demo: no backend is installed; install one, e.g. `pip install meshlift-jit`",
            file=sys.stderr,
        )
        return 1

    # A mesh needs its devices, and XLA_FLAGS only counts before JAX creates its devices.
    needed = math.prod(args.mesh.values())
    _simulate_devices(needed)
    available = jax.device_count()
    if needed > available:
        print(_too_few_devices(args.mesh, needed, available), file=sys.stderr)
        return 1

    result, explanation = run(
        backends, args.mesh, args.steps, args.seed, show=not args.json, sample=args.sample
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_tables(result, explanation)
    if not result["agree"]:
        print(
            f"meshlift demo: the backends do not agree to {TOLERANCE:g}: {disagreement(result)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
