"""`ml.scan_layers`: `jax.lax.scan` unless a backend's trace runs stacks its own way, with
the layers' changed Variables written back as `nnx.scan` writes them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshlift as ml
from meshlift.layers import plain_scan, running


def layer(x, w):
    return jnp.tanh(x @ w), jnp.sum(x)


WEIGHTS = jnp.arange(4 * 3 * 3, dtype=jnp.float32).reshape(4, 3, 3) / 40
X = jnp.ones((2, 3))


def test_outside_a_backend_it_is_jax_lax_scan_with_its_per_layer_outputs():
    got = jax.jit(lambda x, w: ml.scan_layers(layer, x, w))(X, WEIGHTS)
    want = jax.lax.scan(layer, X, WEIGHTS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_within_running_each_stack_goes_to_the_backends_scan_then_back_to_lax_scan():
    calls = []

    def reversed_scan(body, init, xs, state):
        calls.append(jax.tree.structure(xs))
        return plain_scan(body, init, jax.tree.map(lambda a: a[::-1], xs), state)

    with running(reversed_scan):
        inside = ml.scan_layers(layer, X, WEIGHTS)
    assert len(calls) == 1
    np.testing.assert_array_equal(inside[0], jax.lax.scan(layer, X, WEIGHTS[::-1])[0])
    np.testing.assert_array_equal(
        ml.scan_layers(layer, X, WEIGHTS)[0], jax.lax.scan(layer, X, WEIGHTS)[0]
    )
    assert len(calls) == 1


def test_running_is_undone_when_the_trace_raises():
    def failing(body, init, xs, state):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"), running(failing):
        ml.scan_layers(layer, X, WEIGHTS)
    assert ml.scan_layers(layer, X, WEIGHTS)[0].shape == X.shape


class Block(nnx.Module):
    """A layer that changes Variables as it runs: a counter, and its dropout stream's count."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.zeros(()))
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        self.calls[...] += 1
        return self.dropout(self.linear(x))


def stack():
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,))
    def make(rngs):
        return Block(rngs)

    return make(nnx.Rngs(0, dropout=1))


def test_variables_the_layers_change_are_written_back_as_nnx_scan_writes_them():
    @nnx.jit
    def ours(blocks, x):
        return ml.scan_layers(lambda x, block: (block(x), None), x, blocks)[0]

    @nnx.jit
    def flax(blocks, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return run(x, blocks)

    mine, theirs = stack(), stack()
    for _ in range(2):  # the second call draws other dropout masks: the counts moved
        np.testing.assert_array_equal(ours(mine, X), flax(theirs, X))
    np.testing.assert_array_equal(mine.calls[...], [2, 2, 2, 2])
    for a, b in zip(*(jax.tree.leaves(nnx.state(s)) for s in (mine, theirs)), strict=True):
        np.testing.assert_array_equal(numbers(a), numbers(b))


def numbers(array):
    """A key array's data; any other array as it is."""
    is_key = jnp.issubdtype(array.dtype, jax.dtypes.prng_key)
    return jax.random.key_data(array) if is_key else array
