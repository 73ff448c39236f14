"""A gemma-shaped model under `ml.shard_map`, against `nnx.shard_map` on the same code.

flax's gemma example shards in types on an Explicit mesh: `nnx.Einsum`
projections called with `out_sharding=`, and token embeddings looked up with
`nnx.Embed(...)(tokens, out_sharding=...)`. That lookup wraps `jnp.take` in
`jax.sharding.auto_axes` over every mesh axis, which JAX refuses inside a
shard_map (a Manual axis): `nnx.shard_map` raises as `ml.shard_map` does, and
meshlift's note says what to change. Looked up with `.at[ids].get(out_sharding=)`,
the model trains under `ml.shard_map` bit for bit as under `nnx.shard_map`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml

VOCAB, WIDTH, HEADS = 32, 16, 4
TOKENS = P(None, None, "model")  # activations split over `model` (`data` is manual)


class Gemma(nnx.Module):
    """Embedding lookup, one attention block in `out_sharding=` einsums, tied read-out."""

    def __init__(self, lookup, rngs):
        self.lookup = lookup  # "embed": flax's Embed call; "at": `.at[ids].get`
        embedding = {"out_sharding": P("model", None)}
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_metadata=embedding, rngs=rngs)
        split = {"out_sharding": P(None, "model", None)}
        shape = (WIDTH, HEADS, WIDTH // HEADS)
        self.q, self.k, self.v = (
            nnx.Einsum("BTD,DNH->BTNH", shape, kernel_metadata=split, rngs=rngs) for _ in range(3)
        )
        self.o = nnx.Einsum(
            "BTNH,NHD->BTD",
            (HEADS, WIDTH // HEADS, WIDTH),
            kernel_metadata={"out_sharding": P("model", None, None)},
            rngs=rngs,
        )

    def __call__(self, tokens):
        if self.lookup == "embed":
            x = self.embed(tokens, out_sharding=TOKENS)
        else:
            x = self.embed.embedding[...].at[tokens].get(out_sharding=TOKENS)
        heads = P(None, None, "model", None)
        q, k, v = (f(x, out_sharding=heads) for f in (self.q, self.k, self.v))
        weights = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BTNS", q, k), axis=-1)
        x = x + self.o(jnp.einsum("BTNS,BSNH->BTNH", weights, v), out_sharding=TOKENS)
        return self.embed.attend(x, out_sharding=TOKENS)


def step(model, optimizer, tokens):
    def loss_fn(model):
        logits = model(tokens)[:, :-1]
        labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)  # gemma's train.py: one-hot
        loss = -jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1).mean()
        return jax.lax.pmean(loss, "data")  # this shard's rows: the mean over `data`

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes, as gemma's


def made(lookup, mesh):
    with jax.set_mesh(mesh):
        model = Gemma(lookup, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def tokens(mesh):
    ids = jax.random.randint(jax.random.key(1), (8, 6), 0, VOCAB)
    return jax.device_put(ids, jax.NamedSharding(mesh, P("data")))


def lifted(model, mesh):
    plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    return ml.shard_map(
        step, mesh=mesh, axis_names={"data"}, in_specs=(plan, plan, P("data")), out_specs=P()
    )


def flax_shard_map(model, optimizer, mesh):
    """`nnx.shard_map` over `data` (its specs name the manual axes only), under `nnx.jit`."""

    def over_data(node):
        specs = nnx.get_partition_spec(nnx.state(node))
        only_data = jax.tree.map(
            lambda s: P(*(a if a == "data" else None for a in s)),
            specs,
            is_leaf=lambda s: isinstance(s, P),
        )
        return nnx.StateSharding(only_data)

    mapped = nnx.shard_map(
        step,
        mesh=mesh,
        axis_names={"data"},
        in_specs=(over_data(model), over_data(optimizer), P("data")),
        out_specs=P(),
    )
    return nnx.jit(mapped)


def test_flax_embed_lookup_fails_under_both_shard_maps_and_the_note_says_what_to_change(mesh):
    model, optimizer = made("embed", mesh)
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="Going from `Manual`"):
        flax_shard_map(model, optimizer, mesh)(model, optimizer, tokens(mesh))
    model, optimizer = made("embed", mesh)
    before = model.embed.embedding[...]
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="Going from `Manual`") as e:
        lifted(model, mesh)(model, optimizer, tokens(mesh))
    assert ".at[ids].get(out_sharding=...)" in "\n".join(e.value.__notes__)
    assert model.embed.embedding[...] is before  # nothing written back


def test_looked_up_in_types_it_trains_as_under_nnx_shard_map_bit_for_bit(mesh):
    runs = []
    for make_step in (lambda m, o: lifted(m, mesh), lambda m, o: flax_shard_map(m, o, mesh)):
        model, optimizer = made("at", mesh)
        train = make_step(model, optimizer)
        with jax.set_mesh(mesh):
            losses = [train(model, optimizer, tokens(mesh)) for _ in range(3)]
        runs.append((losses, jax.tree.leaves(nnx.state(model, nnx.Param)), model))
    (mine, my_params, model), (theirs, their_params, _) = runs
    np.testing.assert_array_equal(np.array(mine), np.array(theirs))
    for a, b in zip(my_params, their_params, strict=True):
        np.testing.assert_array_equal(a, b)
    assert model.embed.embedding[...].sharding.spec == P("model", None)
    assert float(mine[-1]) < float(mine[0])
