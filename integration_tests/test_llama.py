"""The worked example (docs/llama.md) under every first-party backend, against plain flax.

The model code is the page's own (its blocks marked `# llama: ...`). Plain
flax is the reference: the same code under `nnx.jit` on one device, no mesh and
no rules. Each backend trains it on a 2×4 mesh (the pipeline backend on 2×2×2,
its `layers` over `stage`, in 2 microbatches) and decodes with a KV cache; the
losses, the trained parameters and the generated tokens must be flax's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_docs import DOCS, outputs

import meshlift as ml

STEPS = 4


@functools.cache
def page() -> dict:
    """The page's setup and definitions, run once: Config, Llama, train_step, RULES..."""
    namespace: dict = {"__name__": "__llama__"}
    code = [block[1] for block in outputs.blocks((DOCS / "llama.md").read_text())]
    for block in (code[0], *(b for b in code if b.startswith("# llama: "))):
        exec(compile(block, "docs/llama.md", "exec"), namespace)
    return namespace


def run(train, generate) -> tuple[list[float], np.ndarray]:
    """Losses of `STEPS` training steps, then 6 tokens decoded greedily from a prompt."""
    ns = page()
    data = ns["batches"](ns["Config"](), STEPS)
    losses = [
        float(train(tokens, jnp.arange(8), jax.random.key(i))) for i, tokens in enumerate(data)
    ]
    prompt = ns["batches"](ns["Config"](), 1, batch=4, seed=1)[0][:, :4]
    return losses, generate(prompt)


def decode_loop(decode, model, cache, prompt):
    token = decode(model, cache, prompt)
    tokens = [token]
    for _ in range(5):
        token = decode(model, cache, token[:, None])
        tokens.append(token)
    return np.asarray(jnp.stack(tokens, 1))


def kv_cache(ns, batch):
    c = ns["Config"]()
    shape = (c.layers, batch, c.max_len, c.kv_heads, c.head_dim)
    names = ("layers", "batch", "seq", "kv_heads", "head_dim")
    zeros = ml.with_partitioning(nnx.initializers.zeros_init(), names)

    class KVCache(nnx.Module):
        def __init__(self):
            self.k = nnx.Cache(zeros(None, shape))
            self.v = nnx.Cache(zeros(None, shape))
            self.length = nnx.Cache(jnp.array(0, jnp.int32))

    return KVCache()


def decode_step(model, cache, tokens):
    start = cache.length[...]
    logits, (cache.k[...], cache.v[...]) = model(
        tokens, jnp.arange(tokens.shape[0]), start=start, cache=(cache.k[...], cache.v[...])
    )
    cache.length[...] = start + tokens.shape[1]
    return jnp.argmax(logits[:, -1], -1)


@functools.cache
def reference() -> tuple[list[float], np.ndarray, dict]:
    """Plain flax: nnx.jit on one device."""
    ns = page()
    model = ns["Llama"](ns["Config"](), nnx.Rngs(0))
    optimizer = ns["make_optimizer"](model)
    step = nnx.jit(ns["train_step"])
    decode = nnx.jit(decode_step)
    losses, tokens = run(
        lambda *batch: step(model, optimizer, *batch),
        lambda prompt: decode_loop(decode, model, kv_cache(ns, 4), prompt),
    )
    return losses, tokens, nnx.to_pure_dict(nnx.state(model))


def sharded(backend: str):
    """The step and decoder as the page runs them, under `backend`, and the model."""
    ns = page()
    mesh = ml.make_mesh({"data": 2, "model": 4})
    rules = ns["RULES"] if backend != "shard_map" else ns["TP_RULES"]
    if backend == "pipeline":  # PP x FSDP x TP
        mesh = ml.make_mesh({"stage": 2, "data": 2, "model": 2})
        rules = [("layers", "stage"), *(r for r in rules if r[0] != "layers")]
    with ml.use_mesh(mesh), ml.axis_rules(rules):
        model = ns["Llama"](ns["Config"](), nnx.Rngs(0))
        optimizer = ns["make_optimizer"](model)
        plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    specs = (plan, plan, P("data"), P("data"))
    if backend == "jit":
        step = ml.jit(ns["train_step"], in_shardings=(*specs, None), mesh=mesh)
    elif backend == "pjit":
        step = ml.pjit(ns["train_step"], in_shardings=(*specs, None))
    elif backend == "pipeline":
        step = ml.pipeline(ns["train_step"], microbatches=2, in_shardings=(*specs, None), mesh=mesh)
    else:
        step = ml.shard_map(
            ns["shard_step"],
            mesh=mesh,
            axis_names={"data"},
            in_specs=(*specs, P()),
            out_specs=P(),
        )

    def train(*batch):
        with ml.use_mesh(mesh), ml.axis_rules(rules):
            return step(model, optimizer, *batch)

    def generate(prompt):
        with ml.use_mesh(mesh), ml.axis_rules(rules):
            cache = kv_cache(ns, 4)
            plans = (plan, ml.StateSharding.from_metadata(cache, mesh=mesh), P("data"))
            return decode_loop(ml.jit(decode_step, in_shardings=plans), model, cache, prompt)

    return train, generate, model, plan


@pytest.mark.parametrize("backend", ["jit", "pjit", "shard_map", "pipeline"])
def test_the_worked_example_trains_and_decodes_as_plain_flax(backend):
    train, generate, model, plan = sharded(backend)
    losses, tokens = run(train, generate)
    ref_losses, ref_tokens, ref_params = reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    np.testing.assert_array_equal(tokens, ref_tokens)
    params = nnx.to_pure_dict(nnx.state(model))
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params), strict=True
    ):
        # atol: Adam divides each gradient by its own scale, so a weight whose gradient is
        # near zero moves by about the learning rate (3e-3) on rounding noise alone; the
        # sharded runs sum in another order than one device (jax 0.12: 1.4e-5 on one
        # element of 4,096, every backend alike)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-5, err_msg=str(path))
    kernel = model.blocks.attention.q[...]
    expected = plan.spec_for(("blocks", "attention", "q"), model.blocks.attention.q)
    assert kernel.sharding.spec == expected
    assert expected == {
        "shard_map": P(None, None, "model"),
        "pipeline": P("stage", "data", "model"),
    }.get(backend, P(None, "data", "model"))
