"""`ml.jit` is `jax.jit` for arrays (issue 26): each behaviour run on both, jax the reference."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift import compat


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def test_cache_size_and_clear_cache_count_programs_as_jax_jit_does():
    def double(x):
        return x * 2

    sizes = {}
    for name, wrap in (("jax.jit", jax.jit), ("ml.jit", ml.jit)):
        f, seen = wrap(double), []
        for x in (1.0, 2.0, jnp.ones(3), jnp.ones(3), jnp.ones((2, 2))):
            f(x)
            seen.append(f._cache_size())
        f.clear_cache()
        seen.append(f._cache_size())
        f(1.0)
        seen.append(f._cache_size())
        sizes[name] = seen
    assert sizes["ml.jit"] == sizes["jax.jit"] == [1, 1, 2, 2, 3, 0, 1]


def test_repr_of_a_lifted_object_whose_repr_raises_does_not_raise():
    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no repr")

        def __call__(self, x):
            return x

    assert repr(jax.jit(Unprintable()))  # jax's reference: no exception
    assert repr(ml.jit(Unprintable())) == "<meshlift.jit of a Unprintable>"


def test_a_spec_naming_a_mesh_axis_twice_is_jaxs_duplicate_spec_error(mesh):
    duplicate = compat.duplicate_spec_error()
    assert duplicate is not Exception  # jax's class was found
    x = jnp.ones((8, 8))
    with pytest.raises(duplicate):
        jax.jit(lambda a: a, in_shardings=NamedSharding(mesh, P("data", "data")))(x)
    with pytest.raises(duplicate, match=r"`x` \(shape \(8, 8\)\).*'data' is used twice") as caught:
        ml.jit(lambda x: x, in_shardings=P("data", "data"), mesh=mesh)(x)
    assert isinstance(caught.value, ml.PlanError)  # and meshlift's, with the path
    assert (caught.value.mesh, caught.value.pspec) == (mesh, P("data", "data"))  # jax's fields


def test_jaxs_unspecified_marker_as_a_sharding_leaf_means_none_as_in_jax_jit():
    from jax._src.sharding_impls import UNSPECIFIED

    x = jnp.arange(4.0)
    expected = jax.jit(lambda a, b: a + b, in_shardings=(UNSPECIFIED, None))(x, x)
    got = ml.jit(lambda a, b: a + b, in_shardings=(UNSPECIFIED, None))(x, x)
    assert (got == expected).all() and got.sharding == expected.sharding
    assert ml.jit(lambda a: a, in_shardings=[UNSPECIFIED], out_shardings=UNSPECIFIED)(x).shape == (
        4,
    )
