"""How a call's arguments reach the function: the capabilities the core itself reads.

`TestConformance` inherits these tests. Each needs its capability: a
backend without it must fail the test (a strict expected failure), so the
declaration is checked both ways, as for every capability.

Example: `class TestConformance(ArgumentTraits): ...`
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.testing.capabilities import requires


class ArgumentTraits:
    """`passes-through-none` and `reshards-arguments`, each against `jax.shard_map`'s rule."""

    @requires("passes-through-none")
    def test_a_leaf_that_is_no_array_reaches_the_function_as_it_is(
        self, meshlift_backend, meshlift_mesh
    ):
        seen = []

        def scale(x, n):
            seen.append(type(n))
            return x * n

        scaled = ml.transform(
            meshlift_backend, scale, mesh=meshlift_mesh, in_specs=(P(), None), out_specs=P()
        )
        np.testing.assert_array_equal(scaled(jnp.ones(8), 3), np.full(8, 3.0))
        np.testing.assert_array_equal(scaled(jnp.ones(8), 4), np.full(8, 4.0))
        assert seen == [int, int], f"{meshlift_backend.name} gave the function {seen}"

    @requires("reshards-arguments")
    def test_an_argument_committed_elsewhere_is_moved_onto_its_spec(
        self, meshlift_backend, meshlift_mesh
    ):
        x = jax.device_put(jnp.arange(8.0), NamedSharding(meshlift_mesh, P("model")))
        double = ml.transform(
            meshlift_backend,
            lambda x: x * 2,
            mesh=meshlift_mesh,
            in_specs=(P("data"),),
            out_specs=P("data"),
        )
        out = double(x)
        np.testing.assert_array_equal(out, 2 * np.arange(8.0))
        assert out.sharding.is_equivalent_to(NamedSharding(meshlift_mesh, P("data")), 1)
        assert x.sharding.spec == P("model"), "the caller's array itself is not moved"
