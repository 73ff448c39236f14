"""Orbax checkpoints of lifted models (docs/checkpoints.md): the abstract target that
`eval_shape` gives restores onto any mesh and any plan, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


TP = ml.StateSharding(
    {
        ml.path_endswith("linear1", "kernel"): P(None, "model"),
        ml.path_endswith("linear1", "bias"): P("model"),
        ml.path_endswith("linear2", "kernel"): P("model", None),
        ...: P(),
    }
)
REPLICATED = ml.StateSharding({...: P()})


def make_model():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def leaves(*nodes):
    return jax.tree.leaves([nnx.state(node) for node in nodes])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps on a 2x4 mesh, saved by a CheckpointManager; the saved values as numpy."""
    mesh = ml.make_mesh({"data": 2, "model": 4})
    step = ml.jit(train_step, in_shardings=(TP, TP, P("data"), P("data")), out_shardings=P())
    x = jax.random.normal(jax.random.key(0), (8, 16))
    y = jnp.sin(x)  # made outside `use_mesh`, where it would be committed to the mesh
    with ml.use_mesh(mesh):
        model, optimizer = ml.jit(make_model, out_shardings=TP)()
        for _ in range(2):
            step(model, optimizer, x, y)
    directory = tmp_path_factory.mktemp("checkpoints")
    with ocp.CheckpointManager(directory) as manager:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        manager.save(2, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    return directory, [np.asarray(a) for a in leaves(model, optimizer)]


@pytest.mark.parametrize("plan", [TP, REPLICATED], ids=["tensor-parallel", "replicated"])
@pytest.mark.parametrize(
    "shape",
    [
        {"data": 2, "model": 4},
        {"data": 4, "model": 2},
        {"data": 8, "model": 1},
        {"data": 1, "model": 2},
    ],
    ids=["2x4", "4x2", "8x1", "1x2-on-2-devices"],
)
def test_restore_onto_any_mesh_and_plan(saved, shape, plan):
    directory, expected = saved
    mesh = ml.make_mesh(shape)
    with ml.use_mesh(mesh):
        model, optimizer = ml.jit(make_model, out_shardings=plan).eval_shape()
    target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    wanted = [a.sharding for a in jax.tree.leaves(target)]
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in wanted)

    with ocp.CheckpointManager(directory) as manager:
        assert manager.latest_step() == 2
        restored = manager.restore(2, args=ocp.args.StandardRestore(target))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])

    arrays = leaves(model, optimizer)
    assert [a.sharding for a in arrays] == wanted
    for array, value in zip(arrays, expected, strict=True):
        np.testing.assert_array_equal(array, value)
    spec = P(None, "model") if plan is TP else P()
    assert model.linear1.kernel[...].sharding == NamedSharding(mesh, spec)
    assert optimizer.opt_state[0].nu["linear1"]["kernel"][...].sharding == NamedSharding(mesh, spec)

    step = ml.jit(train_step, in_shardings=(plan, plan, P("data"), P("data")), out_shardings=P())
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jnp.sin(x)
    with ml.use_mesh(mesh):
        step(model, optimizer, x, y)
    assert int(optimizer.step[...]) == 3
    assert model.linear1.kernel[...].sharding == NamedSharding(mesh, spec)


def test_abstract_target_is_the_same_from_jit_and_pjit():
    """Under `shard_map` every device would build a whole model and `out_specs` would
    concatenate them; the target comes from a global-view transform."""
    mesh = ml.make_mesh({"data": 4, "model": 2})
    with ml.use_mesh(mesh):
        reference = jax.tree.leaves(nnx.state(ml.jit(make_model, out_shardings=TP).eval_shape()))
    same = ml.jit(make_model, out_shardings=TP, mesh=mesh).eval_shape()
    assert jax.tree.leaves(nnx.state(same)) == reference
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in reference)
    if "pjit" in {b.name for b in ml.backends()}:
        via_pjit = ml.transform("pjit", make_model, mesh=mesh, out_specs=TP).eval_shape()
        assert jax.tree.leaves(nnx.state(via_pjit)) == reference
