"""`ml.scan_layers`: `jax.lax.scan` unless a backend's trace runs stacks its own way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshlift as ml
from meshlift.layers import running


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

    def reversed_scan(f, init, xs):
        calls.append(jax.tree.structure(xs))
        return jax.lax.scan(f, init, jax.tree.map(lambda a: a[::-1], xs))

    with running(reversed_scan):
        inside = ml.scan_layers(layer, X, WEIGHTS)
    assert len(calls) == 1
    np.testing.assert_array_equal(inside[0], jax.lax.scan(layer, X, WEIGHTS[::-1])[0])
    np.testing.assert_array_equal(
        ml.scan_layers(layer, X, WEIGHTS)[0], jax.lax.scan(layer, X, WEIGHTS)[0]
    )
    assert len(calls) == 1


def test_running_is_undone_when_the_trace_raises():
    def failing(f, init, xs):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"), running(failing):
        ml.scan_layers(layer, X, WEIGHTS)
    assert ml.scan_layers(layer, X, WEIGHTS)[0].shape == X.shape
