"""`ml.jit` is `jax.jit` for arrays (issue 26): each behaviour run on both, jax the reference."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
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


@pytest.mark.parametrize("stage", ["trace", "lower"])
def test_stages_trees_are_the_callers_as_in_jax(stage):
    def f(x, y, *, scale):
        return {"sum": x + y * scale, "x": x}

    args, kwargs = (1.0, jnp.ones(3)), {"scale": 2.0}
    theirs = getattr(jax.jit(f), stage)(*args, **kwargs)
    ours = getattr(ml.jit(f), stage)(*args, **kwargs)
    assert str(ours.in_tree) == str(theirs.in_tree) == "PyTreeDef(((*, *), {'scale': *}))"
    assert ours.out_tree == theirs.out_tree
    if stage == "lower":
        compiled, reference = ours.compile(), theirs.compile()
        assert compiled.in_tree == reference.in_tree and compiled.out_tree == reference.out_tree


def test_compile_takes_jaxs_device_assignment():
    device = (jax.devices()[0],)
    x = jnp.ones(3)
    theirs = jax.jit(lambda a: a * 2).lower(x).compile(device_assignment=device)
    ours = ml.jit(lambda a: a * 2).lower(x).compile(device_assignment=device)
    assert ours(x).devices() == theirs(x).devices() == {jax.devices()[0]}


def test_a_compiled_function_called_with_other_dtypes_names_the_argument():
    def step(scale, model, batch):
        return model(batch) * scale

    model, batch = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), jnp.ones((1, 2))
    reference = jax.jit(lambda batch: batch * 2).lower(batch).compile()
    with pytest.raises(TypeError):  # jax's class for the same mistake
        reference(batch.astype(jnp.int32))
    compiled = ml.jit(step, static_argnums=0).lower(2.0, model, batch).compile()
    with pytest.raises(
        TypeError,
        match=r"step was compiled for other argument types: `batch` "
        r"was float32\[1,2\], is int32\[1,2\]",
    ):
        compiled(model, batch.astype(jnp.int32))
    assert compiled(model, batch).shape == (1, 3)  # still callable with the right types


@pytest.mark.parametrize(
    ("given", "differ"),
    [
        (
            ({"y": jnp.ones(3)}, jnp.ones(3)),
            "given `a.y`, which it was not compiled for; not given `a.x`",
        ),
        (
            ({"x": jnp.ones(3)}, (jnp.ones(3),)),
            "given `b.0`, which it was not compiled for; not given `b`",
        ),
    ],
)
def test_a_compiled_function_given_another_tree_names_the_paths(given, differ):
    def f(a, b):
        return a["x"] + b

    lowered_for = ({"x": jnp.ones(3)}, jnp.ones(3))
    with pytest.raises(TypeError, match="does not match the input pytree"):  # the reference
        jax.jit(f).lower(*lowered_for).compile()(*given)
    compiled = ml.jit(f).lower(*lowered_for).compile()
    with pytest.raises(TypeError) as raised:
        compiled(*given)
    assert str(raised.value) == (
        f"f was compiled for arguments of another structure: {differ}. "
        "Call .lower(...).compile() again for these arguments"
    )


def test_a_compiled_function_given_a_module_of_another_structure_names_its_new_variable():
    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

    model, grown = Scale(), Scale()
    grown.extra = nnx.Param(jnp.ones(2))
    compiled = ml.jit(lambda m, x: m.w[...] * x).lower(model, jnp.ones(3)).compile()
    with pytest.raises(TypeError, match=r"given `m\.extra`, which it was not compiled for\."):
        compiled(grown, jnp.ones(3))
    assert jnp.array_equal(compiled(model, jnp.ones(3)), jnp.ones(3))


def test_an_unreduced_out_sharding_under_set_mesh_is_jax_jits():
    spec = P(unreduced={"x"})
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        theirs = jax.jit(lambda a: a * 2, out_shardings=spec)(jnp.ones(8))
        ours = ml.jit(lambda a: a * 2, out_shardings=spec)(jnp.ones(8))
    assert ours.sharding == theirs.sharding
    assert ours.sharding.spec.unreduced == frozenset({"x"})
