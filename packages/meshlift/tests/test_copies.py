"""Lifted functions copy and pickle as `jax.jit`'s and `nnx.jit`'s functions do."""

import copy

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml


class Trainer:
    """An object holding a model and a lifted method of its own."""

    def __init__(self):
        self.model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.step = ml.jit(self.forward)

    def forward(self, x):
        return self.model(x)


def test_an_object_holding_a_lifted_function_deep_copies_as_under_jax_jit():
    trainer = Trainer()
    trainer.step(jnp.ones((1, 2)))
    twin = copy.deepcopy(trainer)
    twin.model.kernel[...] = 2 * twin.model.kernel[...]
    assert twin.step.__wrapped__.__self__ is twin  # the copy's method, as jax.jit's copy
    np.testing.assert_allclose(twin.step(jnp.ones((1, 2))), twin.forward(jnp.ones((1, 2))))
    assert not np.allclose(twin.step(jnp.ones((1, 2))), trainer.step(jnp.ones((1, 2))))
    reference = copy.deepcopy(jax.jit(trainer.forward))  # jax.jit's functions deep-copy too
    np.testing.assert_allclose(reference(jnp.ones((1, 2))), trainer.step(jnp.ones((1, 2))))


@pytest.mark.parametrize("backend", ["jit", "pjit", "shard_map"])
def test_lifted_functions_round_trip_through_cloudpickle_and_deepcopy(backend):
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(), ...: P()})
    mesh = ml.make_mesh({"data": 8})
    lifted = ml.transform(
        backend, lambda m, x: m(x), in_specs=(plan, P()), out_specs=P(), mesh=mesh
    )
    layer, x = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones((8, 2))
    expected = lifted(layer, x)
    for again in (
        copy.deepcopy(lifted),
        cloudpickle.loads(cloudpickle.dumps(ml.jit(lambda y: y + 1))),
    ):
        assert isinstance(again, ml.Lifted)
    np.testing.assert_allclose(copy.deepcopy(lifted)(layer, x), expected)
    unpickled = cloudpickle.loads(cloudpickle.dumps(ml.jit(lambda y: 2 * y)))
    np.testing.assert_allclose(unpickled(x), 2 * x)
