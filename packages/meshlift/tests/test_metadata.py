"""Sharding metadata: annotate once (NNX or linen), read the plan back, initialise sharded."""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.paths import key_name
from meshlift.plans.annotation import annotated_leaves

RULES = (("batch", "data"), ("hidden", "model"))


# -- flax's linen sharding guide, in meshlift terms ---------------------------------------


class DotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        kernel_init = ml.with_partitioning(self.dense_init, (None, "model"))
        y = nn.Dense(self.depth, kernel_init=kernel_init, use_bias=False)(x)
        y = jax.nn.relu(y)
        w2 = self.param(
            "W2", ml.with_partitioning(self.dense_init, ("model", None)), (self.depth, x.shape[-1])
        )
        return jnp.dot(y, w2), None


class LogicalDotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        kernel_init = ml.with_logical_partitioning(self.dense_init, ("embed", "hidden"))
        y = nn.Dense(self.depth, kernel_init=kernel_init, use_bias=False)(x)
        y = jax.nn.relu(y)
        w2 = self.param(
            "W2",
            ml.with_logical_partitioning(self.dense_init, ("hidden", "embed")),
            (self.depth, x.shape[-1]),
        )
        z = jnp.dot(y, w2)
        return ml.with_logical_constraint(z, ("batch", "embed")), None


class MLP(nn.Module):
    layer: type = DotReluDot
    num_layers: int = 2
    depth: int = 32

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_layers):
            x, _ = self.layer(self.depth)(x)
        return x


def init_fn(key, x, model, optimizer):
    variables = model.init(key, x)
    return train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optimizer
    )


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def annotated_specs(tree):
    """path -> the spec written in the annotation (names as a PartitionSpec)."""
    return {item.path: P(*item.names) for item in annotated_leaves(tree) if item.names is not None}


def specs_of(tree):
    """path -> the sharding spec of each array (boxes unboxed)."""
    flat = jax.tree_util.tree_flatten_with_path(ml.unbox(tree))[0]
    return {tuple(key_name(k) for k in kp): a.sharding.spec for kp, a in flat}


def test_linen_guide_init_sharded_matches_annotations(mesh):
    model, optimizer = MLP(), optax.adam(1e-3)
    key, x = jax.random.key(0), jnp.ones((8, 16))
    abstract = jax.eval_shape(functools.partial(init_fn, model=model, optimizer=optimizer), key, x)
    assert isinstance(abstract.params["DotReluDot_0"]["W2"], nn.Partitioned)  # flax's own box
    state_sharding = ml.get_sharding(abstract, mesh)
    assert state_sharding.params["DotReluDot_0"]["Dense_0"]["kernel"] == NamedSharding(
        mesh, P(None, "model")
    )
    plan = ml.StateSharding.from_metadata(abstract)
    init = ml.jit(
        init_fn, static_argnums=(2, 3), in_shardings=(P(), P("data")), out_shardings=plan, mesh=mesh
    )
    state = init(key, x, model, optimizer)

    expected = annotated_specs(abstract)
    assert len(expected) == 12  # 4 params, and mu and nu of each
    actual = specs_of(state)
    for path, spec in expected.items():
        assert actual[path] == spec, path
    assert actual[("step",)] == P()
    # jax.jit takes ml.get_sharding's tree directly, as in flax's guide
    plain = jax.jit(init_fn, static_argnums=(2, 3), out_shardings=state_sharding)(
        key, x, model, optimizer
    )
    assert specs_of(plain) == actual

    # the logical version, with the guide's rules, gives identical shardings
    logical_model = MLP(layer=LogicalDotReluDot)
    logical_abstract = jax.eval_shape(
        functools.partial(init_fn, model=logical_model, optimizer=optimizer), key, x
    )
    assert isinstance(logical_abstract.params["LogicalDotReluDot_0"]["W2"], nn.LogicallyPartitioned)
    assert ml.get_partition_spec(logical_abstract).params["LogicalDotReluDot_0"]["W2"] == P(
        "hidden", "embed"
    )  # no rules: the logical names, for ml.logical_to_mesh
    with ml.axis_rules(RULES):
        logical_plan = ml.StateSharding.from_metadata(logical_abstract)
        assert ml.get_sharding(logical_abstract, mesh).params["LogicalDotReluDot_1"]["W2"] == (
            NamedSharding(mesh, P("model", None))
        )
    logical_init = ml.jit(init_fn, static_argnums=(2, 3), out_shardings=logical_plan, mesh=mesh)
    with ml.use_mesh(mesh), ml.axis_rules(RULES):
        logical_state = logical_init(key, x, logical_model, optimizer)
    renamed = {
        tuple(p.replace("LogicalDotReluDot", "DotReluDot") for p in path): spec
        for path, spec in specs_of(logical_state).items()
    }
    assert renamed == actual

    # and it trains: a step keeps the shardings
    def train_step(state, x):
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    step = ml.jit(train_step, in_shardings=(plan, P("data")), out_shardings=plan, mesh=mesh)
    assert specs_of(step(state, x)) == actual


def test_ml_jit_takes_get_sharding_tree_as_out_shardings(mesh):
    model, optimizer = MLP(), optax.adam(1e-3)
    key, x = jax.random.key(0), jnp.ones((8, 16))
    abstract = jax.eval_shape(functools.partial(init_fn, model=model, optimizer=optimizer), key, x)
    init = ml.jit(
        init_fn, static_argnums=(2, 3), out_shardings=ml.get_sharding(abstract, mesh), mesh=mesh
    )
    state = init(key, x, model, optimizer)
    assert specs_of(state)[("params", "DotReluDot_0", "W2")] == P("model", None)


# -- NNX ------------------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(
            16,
            32,
            kernel_init=ml.with_partitioning(init, (None, "model")),
            bias_init=ml.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
            rngs=rngs,
        )
        self.linear2 = nnx.Linear(
            32, 16, kernel_init=ml.with_logical_partitioning(init, ("hidden", "embed")), rngs=rngs
        )

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def test_nnx_metadata_plan_runs_under_jit_and_matches_single_device(mesh):
    model = Net(nnx.Rngs(0))
    assert model.linear1.kernel.get_metadata()["out_sharding"] == (None, "model")
    reference = nnx.clone(model)
    with ml.axis_rules(RULES):
        plan = ml.StateSharding.from_metadata(model)
    assert plan.spec_for(("linear2", "kernel"), model.linear2.kernel) == P("model", None)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jnp.sin(x)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = ml.jit(
        train_step, in_shardings=(plan, plan, P("data"), P("data")), out_shardings=P(), mesh=mesh
    )
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    ref_step = nnx.jit(train_step)
    for _ in range(3):
        loss = step(model, optimizer, x, y)
        ref_loss = ref_step(reference, ref_optimizer, x, y)
    assert model.linear1.kernel[...].sharding.spec == P(None, "model")
    assert model.linear1.bias[...].sharding.spec == P("model")
    assert model.linear2.kernel[...].sharding.spec == P("model", None)
    assert optimizer.opt_state[0].mu["linear1"]["kernel"][...].sharding.spec == P(None, "model")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        model.linear2.kernel[...], reference.linear2.kernel[...], rtol=1e-5, atol=1e-6
    )


def test_nnx_get_partition_spec_and_get_sharding(mesh):
    model = Net(nnx.Rngs(0))
    specs = ml.get_partition_spec(model)
    assert isinstance(specs, nnx.State)
    assert specs["linear1"]["kernel"].get_value() == P(None, "model")
    assert specs["linear2"]["kernel"].get_value() == P("hidden", "embed")  # no rules: as written
    assert specs["linear2"]["bias"].get_value() == P()
    with pytest.raises(ml.PlanError, match=r"linear2\.kernel.*logical names.*ml\.axis_rules"):
        ml.get_sharding(model, mesh)
    shardings = ml.get_sharding(model, mesh, rules=RULES)
    assert shardings["linear2"]["kernel"].get_value() == NamedSharding(mesh, P("model", None))
    # usable as a plan at a module's position
    forward = ml.jit(lambda m, x: m(x), in_shardings=(shardings, P("data")), mesh=mesh)
    forward(model, jnp.ones((8, 16)))
    assert model.linear2.kernel[...].sharding.spec == P("model", None)


def test_nnx_eager_placement_under_use_mesh(mesh):
    with ml.use_mesh(mesh):
        model = Net(nnx.Rngs(0))
    assert model.linear1.kernel[...].sharding.spec == P(None, "model")


def test_flax_own_annotations_read_the_same(mesh):
    layer = nnx.Linear(
        16,
        32,
        rngs=nnx.Rngs(0),
        kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "model"), eager_sharding=False
        ),
    )
    assert ml.get_partition_spec(layer)["kernel"].get_value() == P(None, "model")
    variables = jax.eval_shape(
        nn.Dense(
            8,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "hidden")
            ),
        ).init,
        jax.random.key(0),
        jnp.ones((2, 4)),
    )
    assert ml.get_sharding(variables, mesh, RULES)["params"]["kernel"].spec == P(None, "model")


def test_get_sharding_lists_every_problem_with_its_path(mesh):
    tree = {
        "a": nn.Partitioned(jax.ShapeDtypeStruct((6, 8), jnp.float32), ("model", None)),
        "b": nn.Partitioned(jax.ShapeDtypeStruct((8,), jnp.float32), ("expert",)),
        "c": jnp.ones(3),
    }
    with pytest.raises(ml.PlanError) as error:
        ml.get_sharding(tree, mesh)
    message = str(error.value)
    assert "2 parameter(s)" in message
    assert "`a` (shape (6, 8), spec P('model', None))" in message and "not divisible" in message
    assert "`b`" in message and "'expert' is not in the mesh" in message


def test_unbox_and_replace_boxed():
    box = nn.Partitioned(jnp.zeros(4), ("model",))
    tree = {"w": box, "n": jnp.ones(2)}
    plain = ml.unbox(tree)
    assert isinstance(plain["w"], jax.Array)
    new = ml.replace_boxed(tree, {"w": jnp.ones(4), "n": jnp.zeros(2)})
    assert isinstance(new["w"], nn.Partitioned) and new["w"].names == ("model",)
    np.testing.assert_array_equal(new["w"].value, jnp.ones(4))

    model = Net(nnx.Rngs(0))
    pure = ml.unbox(model)
    assert pure["linear1"]["kernel"].shape == (16, 32)
    pure["linear1"]["bias"] = jnp.full((32,), 3.0)
    assert ml.replace_boxed(model, pure) is model
    assert float(model.linear1.bias[0]) == 3.0
    assert model.linear1.bias.get_metadata()["out_sharding"] == ("model",)


def test_add_axis_and_remove_axis_for_stacked_layers():
    tree = {"k": nn.Partitioned(jnp.zeros((4, 8)), (None, "model"))}
    stacked = ml.add_axis(tree, 0, "layers")
    assert stacked["k"].names == ("layers", None, "model")
    assert ml.get_partition_spec(stacked)["k"] == P("layers", None, "model")
    assert ml.remove_axis(stacked, 0, "layers")["k"].names == (None, "model")

    model = Net(nnx.Rngs(0))
    ml.add_axis(model, 0, "layers")
    assert model.linear1.kernel.get_metadata()["out_sharding"] == ("layers", None, "model")
    assert model.linear1.bias.get_metadata()["out_sharding"] == ("layers", "model")
    ml.remove_axis(model, 0, "layers")
    assert model.linear1.kernel.get_metadata()["out_sharding"] == (None, "model")
    with pytest.raises(ValueError, match="Expected to remove"):
        ml.remove_axis(model, 0, "layers")
