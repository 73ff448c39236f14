"""Old pjit training steps (linen params, optax, TrainState) give the numbers of ml.jit and one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

TX = optax.adam(1e-2)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="hidden")(x))
        return nn.Dense(16, name="out")(x)


# What old pjit code wrote by hand: spec trees shaped like the params and the optimizer state.
PARAM_SPECS = {
    "hidden": {"kernel": P(None, "model"), "bias": P("model")},
    "out": {"kernel": P("model", None), "bias": None},
}
OPT_SPECS = (optax.ScaleByAdamState(count=None, mu=PARAM_SPECS, nu=PARAM_SPECS), optax.EmptyState())

# The same layout as a plan, for a TrainState or an NNX module.
PLAN = ml.StateSharding(
    {
        ml.path_endswith("hidden", "kernel"): P(None, "model"),
        ml.path_endswith("hidden", "bias"): P("model"),
        ml.path_endswith("out", "kernel"): P("model", None),
        ...: P(),
    }
)


def data():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    return x, jnp.sin(x)


def init_params():
    return MLP().init(jax.random.key(0), jnp.ones((1, 16)))["params"]


def loss_fn(params, x, y):
    return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)


def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def state_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss


def new_state():
    return train_state.TrainState.create(apply_fn=MLP().apply, params=init_params(), tx=TX)


def run(step, *state, steps=3):
    x, y = data()
    losses = []
    for _ in range(steps):
        *state, loss = step(*state, x, y)
        losses.append(float(loss))
    return state, losses


def assert_close(a, b, tol=1e-5):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=tol, rtol=tol)


def test_old_pjit_linen_adam_step_matches_ml_jit_and_one_device(mesh, old_style):
    params = init_params()
    specs = (PARAM_SPECS, OPT_SPECS, P("data"), P("data"))
    with old_style(mesh):
        step = ml.pjit(train_step, in_axis_resources=specs, out_axis_resources=(*specs[:2], None))
        (got_params, got_opt), losses = run(step, params, TX.init(params))
    jit_step = ml.jit(train_step, in_shardings=specs, mesh=mesh)
    (jit_params, jit_opt), jit_losses = run(jit_step, params, TX.init(params))
    (ref_params, ref_opt), ref_losses = run(jax.jit(train_step), params, TX.init(params))

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(losses, jit_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert_close((got_params, got_opt), (ref_params, ref_opt))
    assert_close((got_params, got_opt), (jit_params, jit_opt))
    kernel = got_params["hidden"]["kernel"]
    assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
    assert got_opt[0].mu["out"]["kernel"].sharding == NamedSharding(mesh, P("model", None))
    assert got_params["out"]["bias"].sharding.is_fully_replicated  # None: replicated


def test_positional_specs_on_a_train_state_with_a_plan(mesh, old_style):
    with old_style(mesh):
        step = ml.pjit(state_step, (PLAN, P("data"), P("data")), (PLAN, None))
        (state,), losses = run(step, new_state())
    (ref,), ref_losses = run(jax.jit(state_step), new_state())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(state.params, ref.params)
    assert int(state.step) == 3
    assert state.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    assert state.opt_state[0].nu["hidden"]["bias"].sharding.spec == P("model")


def test_train_state_shaped_spec_tree(mesh, old_style):
    state = new_state()
    spec = state.replace(step=None, params=PARAM_SPECS, opt_state=OPT_SPECS)
    with old_style(mesh):
        step = ml.pjit(state_step, (spec, P("data"), P("data")), (spec, None))
        (got,), losses = run(step, state)
    (ref,), ref_losses = run(jax.jit(state_step), new_state())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(got.params, ref.params)
    assert got.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    assert got.opt_state[0].mu["out"]["kernel"].sharding.spec == P("model", None)
    assert got.step.sharding.is_fully_replicated  # None: replicated


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def nnx_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def test_nnx_module_with_plan_matches_ml_jit(mesh):
    def fresh():
        model = NNXMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    specs = (PLAN, PLAN, P("data"), P("data"))
    x, y = data()
    model, opt = fresh()
    step = ml.pjit(nnx_step, specs, None)
    with ml.use_mesh(mesh):
        losses = [float(step(model, opt, x, y)) for _ in range(3)]
    jit_model, jit_opt = fresh()
    jit_step = ml.jit(nnx_step, in_shardings=specs, mesh=mesh)
    jit_losses = [float(jit_step(jit_model, jit_opt, x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, jit_losses, rtol=1e-5)
    assert_close(nnx.state(model), nnx.state(jit_model))
    assert model.hidden.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    assert int(opt.step[...]) == 3
