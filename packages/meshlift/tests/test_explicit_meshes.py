"""Explicit meshes, jax's default (`jax.make_mesh`), as the main case.

Each test runs the same code under jax or flax as its reference: flax's
`nnx.with_partitioning` on the mesh, `jax.jit` under `jax.set_mesh`.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshlift as ml


@pytest.fixture(scope="module")
def mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    assert mesh.are_all_axes_explicit
    return mesh


LECUN = nnx.initializers.lecun_normal()


@pytest.mark.parametrize(
    "init",
    [
        lambda: ml.with_partitioning(LECUN, (None, "model")),
        lambda: ml.with_logical_partitioning(LECUN, (None, "mlp"), rules=[("mlp", "model")]),
    ],
    ids=["with_partitioning", "with_logical_partitioning"],
)
def test_metadata_helpers_place_parameters_as_flax_does(mesh, init):
    with jax.set_mesh(mesh):
        mine = nnx.Linear(8, 16, kernel_init=init(), rngs=nnx.Rngs(0))
        flax = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(LECUN, (None, "model")), rngs=nnx.Rngs(0)
        )
    assert mine.kernel[...].sharding == flax.kernel[...].sharding
    assert mine.kernel[...].sharding.spec == P(None, "model")
    np.testing.assert_array_equal(mine.kernel[...], flax.kernel[...])


def zeros_in_types(x):
    return x + jnp.zeros((8, 4), out_sharding=P("data"))  # needs a mesh in context


@pytest.mark.parametrize("given", ["mesh", "function"])
def test_mesh_is_the_traced_functions_mesh_context(mesh, given):
    x = jnp.ones((8, 4))
    mine = ml.jit(zeros_in_types, mesh=mesh if given == "mesh" else lambda: mesh)(x)
    with jax.set_mesh(mesh):
        theirs = jax.jit(zeros_in_types)(x)
    assert mine.sharding == theirs.sharding
    assert mine.sharding.spec == P("data", None)
    np.testing.assert_array_equal(mine, theirs)
    assert jax.sharding.get_abstract_mesh().empty  # the caller's context is left as it was


@pytest.mark.parametrize("given", ["mesh", "function"])
def test_a_function_of_no_arrays_is_placed_in_the_mesh_given(mesh, given):
    """JAX needs the mesh in context to place `f32[8@data,4]`; mesh= (or the function
    giving one) is that context, for the call and its lowering."""

    def zeros():
        return jnp.zeros((8, 4), out_sharding=P("data"))

    mine = ml.jit(zeros, mesh=mesh if given == "mesh" else lambda: mesh)
    with jax.set_mesh(mesh):
        theirs, lowered = jax.jit(zeros)(), jax.jit(zeros).lower()
    assert mine().sharding == theirs.sharding
    placed = re.search(r"sdy\.sharding = (#sdy\.sharding<[^>]*>)", lowered.as_text())[1]
    assert placed in mine.lower().as_text()  # the result placed as jax places it


def test_eval_shape_then_trace_traces_once_as_jax_jit(mesh):
    traces = []

    def forward(m, x):
        traces.append(1)
        return m(x)

    model, x = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), jnp.ones((1, 2))
    lifted = ml.jit(forward)
    shape = jax.eval_shape(lifted, model, x)
    lifted.trace(model, x)
    lifted(model, x)
    assert shape.shape == (1, 3) and len(traces) == 1

    def plain(x):
        traces.append(1)
        return 2 * x

    traces.clear()
    reference = jax.jit(plain)
    jax.eval_shape(reference, x)
    reference.trace(x)
    assert len(traces) == 1


def test_an_auto_mesh_under_code_that_shards_in_types_says_how_to_make_the_mesh():
    auto = ml.make_mesh({"data": 2, "model": 4})  # Auto axes, ml.make_mesh's default

    def project(x, w):
        return jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))

    x, w = jnp.ones((8, 4)), jnp.ones((4, 8))
    with jax.set_mesh(auto), pytest.raises(ValueError, match="of type Auto") as theirs:
        jax.jit(project)(x, w)
    with pytest.raises(type(theirs.value), match="of type Auto") as mine:
        ml.jit(project, mesh=auto)(x, w)
    note = "\n".join(mine.value.__notes__)
    assert "ml.make_mesh({'data': 2, 'model': 4}, axis_types=(AxisType.Explicit,) * 2)" in note
    explicit = ml.make_mesh({"data": 2, "model": 4}, axis_types=(AxisType.Explicit,) * 2)
    assert ml.jit(project, mesh=explicit)(x, w).sharding.spec == P("data", "model")
