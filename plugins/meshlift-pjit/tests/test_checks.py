"""Old pjit's checks: raised before tracing, naming the argument path and saying how to fix it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jax.nn.relu(self.linear1(x)))


@pytest.fixture
def traces():
    """A list that grows each time ``forward`` is traced."""
    return []


@pytest.fixture
def forward(traces):
    def forward(model, batch):
        traces.append(1)
        return model(batch["x"])

    return forward


def plan_with(kernel_spec):
    return ml.StateSharding({ml.path_endswith("linear1", "kernel"): kernel_spec, ...: P()})


def batch(width=16):
    return {"x": jnp.ones((8, width))}


def call(forward, mesh, *specs, args=None, **names):
    f = ml.pjit(forward, *specs, **names)
    with ml.use_mesh(mesh):
        return f(*(args or (MLP(nnx.Rngs(0)), batch())))


def test_no_mesh_in_context(forward, traces):
    f = ml.pjit(forward, in_axis_resources=(plan_with(P()), P("data")))
    with pytest.raises(ml.PlanError, match="no mesh is known") as info:
        f(MLP(nnx.Rngs(0)), batch())
    assert "`model.linear1.bias` has the bare spec P()" in str(info.value)
    assert "with ml.use_mesh(mesh):" in str(info.value)
    assert traces == []


def test_mesh_axis_used_twice(forward, traces, mesh):
    with pytest.raises(ml.PlanError) as info:
        call(forward, mesh, (plan_with(P("model", "model")), P("data")))
    message = str(info.value)
    assert "`model.linear1.kernel`" in message
    assert re.search(
        "a single in_axis_resources specification can map every mesh axis to at most one "
        "positional dimension",
        message,
        re.IGNORECASE,
    )
    assert traces == []


def test_spec_longer_than_rank(forward, traces, mesh):
    with pytest.raises(ml.PlanError) as info:
        call(forward, mesh, (plan_with(P(None, None, "model")), P("data")))
    assert "`model.linear1.kernel`" in str(info.value)
    assert "rank 2" in str(info.value)
    assert traces == []


def test_axis_the_mesh_lacks(forward, traces, mesh):
    with pytest.raises(ml.PlanError) as info:
        call(forward, mesh, (plan_with(P()), {"x": P("expert")}))
    assert "`batch.x`" in str(info.value)
    assert re.search("did you forget to declare the mesh", str(info.value), re.IGNORECASE)
    assert traces == []


def test_dimension_not_divisible(forward, traces, mesh):
    model = MLP(nnx.Rngs(0))
    model.linear1 = nnx.Linear(16, 30, rngs=nnx.Rngs(1))  # 30 is not divisible by model=4
    model.linear2 = nnx.Linear(30, 16, rngs=nnx.Rngs(2))
    with pytest.raises(ml.PlanError) as info:
        call(forward, mesh, (plan_with(P(None, "model")), P("data")), args=(model, batch()))
    assert "`model.linear1.kernel`" in str(info.value)
    assert "not divisible by 4" in str(info.value)
    assert traces == []


def test_output_axis_the_mesh_lacks_names_out_axis_resources(forward, traces, mesh):
    with pytest.raises(ml.PlanError, match="out_axis_resources") as info:
        call(forward, mesh, (plan_with(P()), P("data")), P("expert"))
    assert "`output`" in str(info.value)
    assert traces == []


def test_messages_use_the_name_the_caller_used(forward, mesh):
    with pytest.raises(ml.PlanError, match="single in_shardings specification"):
        call(forward, mesh, in_shardings=(plan_with(P("model", "model")), P("data")))


def test_old_and_new_names_together():
    with pytest.raises(ValueError, match="in_axis_resources is the old name of in_shardings"):
        ml.pjit(lambda x: x, P("data"), in_shardings=P("data"))
    with pytest.raises(ValueError, match="out_axis_resources is the old name of out_shardings"):
        ml.pjit(lambda x: x, out_axis_resources=None, out_shardings=None)


def test_transform_reads_old_names_and_none_as_pjit_does(mesh):
    f = ml.transform("pjit", lambda x: x * 2, in_axis_resources=P("data"), out_specs=P("data"))
    x = jnp.ones(8)
    with ml.use_mesh(mesh):
        y = f(x)
    assert y.sharding.spec == P("data")
    g = ml.transform("pjit", lambda x: (x * 2,), in_specs=P("data"), out_specs=(None,))
    with ml.use_mesh(mesh):
        (z,) = g(x)
    assert z.sharding.spec == P()  # None is replicated, as in old pjit
    with pytest.raises(ValueError, match=r"both in_axis_resources= and in_specs="):
        ml.transform("pjit", lambda x: x, in_axis_resources=P(), in_specs=P())


def test_transform_without_a_mesh():
    np.testing.assert_array_equal(ml.transform("pjit", lambda x: x + 1)(jnp.ones(8)), 2.0)
    g = ml.transform("pjit", lambda x: x + 1, in_specs=P("data"))
    with pytest.raises(ml.PlanError, match="`x` has the bare spec P"):
        g(jnp.ones(8))
