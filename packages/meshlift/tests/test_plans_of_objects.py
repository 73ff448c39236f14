"""A plan made from an object means the same wherever that object is passed.

The reference is flax's recipe: `nnx.get_named_sharding(state, mesh)` as
`jax.jit`'s `in_shardings`/`out_shardings`, which keeps every parameter on
its annotated sharding. meshlift's plans from `StateSharding.from_metadata`,
`ml.get_sharding` and `ml.get_partition_spec` are asked with each
parameter's path below the object they were given for.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import meshlift as ml

SHARDED = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.layer = nnx.Linear(8, 16, kernel_init=SHARDED, rngs=rngs)

    def __call__(self, x):
        return self.layer(x)


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def placed_state(mesh):
    """flax's TrainState holding NNX parameters, placed as its metadata says."""
    with ml.use_mesh(mesh):
        model = Model(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    state = train_state.TrainState.create(
        apply_fn=graphdef.apply, params=params, tx=optax.adam(1e-3)
    )
    return jax.device_put(state, nnx.get_named_sharding(state, mesh))


def train(state):
    def loss(params):
        return jnp.mean(state.apply_fn(params)(jnp.ones((4, 8)))[0] ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def kernels(state):
    """The parameter and both Adam moments of the kernel."""
    adam = state.opt_state[0]
    return [state.params["layer"]["kernel"], adam.mu["layer"]["kernel"], adam.nu["layer"]["kernel"]]


def _array(x):
    return x[...] if isinstance(x, nnx.Variable) else x


@pytest.mark.parametrize("backend", ["jit", "pjit"])
def test_a_plan_from_a_train_state_keeps_its_placement_as_flax_and_jax_jit_do(mesh, backend):
    state, reference_state = placed_state(mesh), placed_state(mesh)
    plan = ml.StateSharding.from_metadata(state, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no filter goes unmatched
        lifted = ml.transform(backend, train, mesh=mesh, in_specs=(plan,), out_specs=plan)
        with ml.use_mesh(mesh):
            out = lifted(state)
    named = nnx.get_named_sharding(reference_state, mesh)
    reference = jax.jit(train, in_shardings=(named,), out_shardings=named)(reference_state)
    for mine, theirs, caller in zip(kernels(out), kernels(reference), kernels(state), strict=True):
        assert _array(mine).sharding.spec == _array(theirs).sharding.spec == P(None, "model")
        assert _array(caller).sharding.spec == P(None, "model")  # the caller's, not moved
        np.testing.assert_allclose(_array(mine), _array(theirs), rtol=1e-6)


def test_get_sharding_and_get_partition_spec_are_taken_as_specs(mesh):
    with ml.use_mesh(mesh):
        params = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
    double = lambda p: jax.tree.map(lambda x: 2 * x, p)  # noqa: E731
    out = ml.jit(double, in_shardings=(ml.get_sharding(params, mesh),), mesh=mesh)(params)
    assert out["layer"]["kernel"][...].sharding.spec == P(None, "model")
    with ml.use_mesh(mesh):
        specs = ml.get_partition_spec(params)
        out = ml.pjit(double, in_axis_resources=(specs,), out_axis_resources=specs)(params)
    assert out["layer"]["kernel"][...].sharding.spec == P(None, "model")


def test_a_plan_made_from_a_container_of_modules_applies_inside_it(mesh):
    with ml.use_mesh(mesh):
        models = {"student": Model(nnx.Rngs(0)), "teacher": Model(nnx.Rngs(1))}
    plan = ml.StateSharding.from_metadata(models)
    forward = ml.jit(
        lambda ms, x: ms["student"](x) - ms["teacher"](x), in_shardings=(plan, P()), mesh=mesh
    )
    forward(models, jnp.ones((2, 8)))
    for model in models.values():
        assert model.layer.kernel[...].sharding.spec == P(None, "model")


def test_a_plan_made_from_another_object_is_refused_naming_its_filters_and_the_paths(mesh):
    state = placed_state(mesh)
    plan = ml.StateSharding.from_metadata(state)  # paths start with `params`, `opt_state`
    with ml.use_mesh(mesh):
        other = Model(nnx.Rngs(0))
    before = other.layer.kernel[...]
    forward = ml.jit(lambda m, x: m(x), in_shardings=(plan, P()), mesh=mesh)
    with pytest.raises(ml.PlanError, match="no filter of the plan in in_shardings") as error:
        forward(other, jnp.ones((2, 8)))
    assert "annotation 'params.layer.kernel'" in str(error.value)
    assert "`m.layer.bias`, `m.layer.kernel`" in str(error.value)
    assert "on mesh {'data': 2, 'model': 4}" in str(error.value)
    assert other.layer.kernel[...] is before  # nothing moved
