"""A static value changed in place inside a lifted function: a cache miss, never a refusal.

JAX runs a function's Python once per trace. When a trace changes a static
value in place (optax's cosine schedule turns `decay_steps` 8 into 8.0 on
first use), the call keeps the change as eager execution does and forgets
its program, so the next call traces and runs the Python again. Each test
runs the same code eagerly (or under `nnx.jit`) as its reference.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml


class Counter:
    """A static configuration the function changes in place on every run."""

    def __init__(self):
        self.n = 0


def counted_model():
    model = nnx.Module()
    model.config, model.w = Counter(), nnx.Param(jnp.ones(2))
    return model


def count_and_scale(m, x):
    m.config.n += 1
    return m.w[...] * x * m.config.n


@pytest.mark.parametrize("backend", ["jit", "pjit", "shard_map"])
def test_a_change_on_every_call_retraces_every_call_as_eager_runs(backend):
    mesh = ml.make_mesh({"data": 2, "model": 4})
    lifted = ml.transform(backend, count_and_scale, mesh=mesh, in_specs=P(), out_specs=P())
    model, eager, x = counted_model(), counted_model(), jnp.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            np.testing.assert_array_equal(lifted(model, x), count_and_scale(eager, x))
            assert model.config.n == eager.config.n
    retraces = [w for w in caught if issubclass(w.category, ml.RetraceWarning)]
    assert len(retraces) == 1  # once it keeps happening, naming the path and the user's line
    assert "changes `m.config` in place" in str(retraces[0].message)
    assert retraces[0].filename == __file__


def test_a_change_that_settles_costs_one_more_trace():
    model = nnx.Module()
    model.config, model.w = {"steps": None}, nnx.Param(jnp.ones(2))
    traces = []

    def lazily_set(m, x):
        traces.append(1)
        if m.config["steps"] is None:
            m.config["steps"] = 4  # set on first use, as a lazy cache or a memo would
        return m.w[...] * x * m.config["steps"]

    lifted = ml.jit(lazily_set)
    for _ in range(4):
        np.testing.assert_array_equal(lifted(model, jnp.ones(2)), 4 * jnp.ones(2))
    assert model.config == {"steps": 4}
    assert len(traces) == 2


def test_a_number_made_an_equal_one_of_another_type_is_no_change():
    # optax's cosine schedule turns its closure's `decay_steps` 8 into 8.0 on first use:
    # equal under ==, so the program is kept (compared by type, it would trace twice).
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(optax.cosine_decay_schedule(0.1, 8)), wrt=nnx.Param)
    traces = []

    def step(model, optimizer, x):
        traces.append(1)
        optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(x)))(model))

    lifted = ml.jit(step)
    for _ in range(3):
        lifted(model, optimizer, jnp.ones((1, 2)))
    assert len(traces) == 1


def test_a_call_that_raises_undoes_the_change():
    model = counted_model()

    def then_fail(m, x):
        m.config.n += 1
        return jnp.ones(3) + x  # a shape error, raised by JAX once the Python has run

    with pytest.raises(TypeError):
        ml.jit(then_fail)(model, jnp.ones(2))
    assert model.config.n == 0

    def raise_inside(m, x):
        m.config.n += 1
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        ml.jit(raise_inside)(model, jnp.ones(2))
    assert model.config.n == 0


def remember_shape(m, x):
    if x.shape not in m.config.seen:  # a memo filled on first use of each shape
        m.config.seen.append(x.shape)
    return m.w[...][: x.shape[0]] * x


def memo_model():
    model = nnx.Module()
    model.config, model.w = Counter(), nnx.Param(jnp.ones(3))
    model.config.seen = []
    return model


def test_a_repeated_call_whose_program_traces_again_keeps_the_change(monkeypatch):
    # A call like the last runs on its plan; a new input shape makes JAX trace again there.
    from meshlift.call import static_changes

    adopted, adopt = [], static_changes.adopt

    def adopt_and_note(since):
        token = adopt(since)
        adopted.append(static_changes.pending())
        return token

    monkeypatch.setattr(static_changes, "adopt", adopt_and_note)
    model, eager, lifted = memo_model(), memo_model(), ml.jit(remember_shape)
    for size in (2, 2, 2, 3, 3, 3, 2):
        x = jnp.arange(size, dtype=jnp.float32)
        np.testing.assert_array_equal(lifted(model, x), remember_shape(eager, x))
        assert model.config.seen == eager.config.seen
    # the plan's program traced again for (3,), and that call took the change as its own
    assert [paths for paths in adopted if paths] == [("m.config",)]


def test_a_repeated_call_whose_program_fails_undoes_the_change():
    def remember_then_fail(m, x):
        remember_shape(m, x)
        return jnp.ones(2) + x  # fails for any shape but (2,), after the memo changed

    model, lifted = memo_model(), ml.jit(remember_then_fail)
    for _ in range(3):
        lifted(model, jnp.ones(2))
    assert lifted._plan is not None and model.config.seen == [(2,)]
    with pytest.raises(TypeError, match="incompatible shapes"):
        lifted(model, jnp.ones(3))
    assert model.config.seen == [(2,)]
    np.testing.assert_array_equal(lifted(model, jnp.ones(2)), 2 * jnp.ones(2))


def test_an_object_the_function_makes_and_stores_is_made_anew_each_call_as_eagerly():
    # Found by the oracle: a program replayed without running the Python handed the caller
    # the list its trace made, which the caller had changed in place since.
    def remember(m, x):
        m.config = [1.0]  # a new static object, stored on the module
        return m.w[...] * x

    model, eager, lifted, x = counted_model(), counted_model(), ml.jit(remember), jnp.ones(2)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ml.RetraceWarning)
        for step in range(4):
            np.testing.assert_array_equal(lifted(model, x), remember(eager, x))
            assert model.config == eager.config == [1.0], step
            assert all(model.config is not before for before in seen)  # a new list each time
            seen.append(model.config)
            model.config.append(2.0)  # the caller changes what the call gave it
            eager.config.append(2.0)


def test_stages_undo_the_change_and_the_next_call_runs_the_python():
    model, eager, x = counted_model(), counted_model(), jnp.ones(2)
    lifted = ml.jit(count_and_scale)
    lifted.trace(model, x)
    lifted.lower(model, x)
    assert lifted.eval_shape(model, x).shape == (2,)
    assert model.config.n == 0  # a stage writes nothing back
    np.testing.assert_array_equal(lifted(model, x), count_and_scale(eager, x))
    assert model.config.n == eager.config.n == 1


def test_an_output_plan_traced_abstractly_leaves_the_change_to_the_call():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    plan = ml.StateSharding({...: P()})
    model, eager, x = counted_model(), counted_model(), jnp.ones(2)

    def count_and_return(m, x):
        return m, count_and_scale(m, x)

    lifted = ml.jit(count_and_return, out_shardings=(plan, None), mesh=mesh)
    for _ in range(2):
        out, y = lifted(model, x)
        np.testing.assert_array_equal(y, count_and_return(eager, x)[1])
        assert out is model and model.config.n == eager.config.n


@pytest.mark.parametrize(
    "schedule",
    [
        optax.cosine_decay_schedule(1e-2, 8),
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 8),
        optax.sgdr_schedule(
            [{"init_value": 0.0, "peak_value": 1e-2, "warmup_steps": 2, "decay_steps": 8}] * 2
        ),
    ],
    ids=["cosine", "warmup_cosine", "sgdr"],
)
def test_optax_cosine_schedules_train_as_under_nnx_jit(schedule):
    def make():
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    (model, optimizer), (ref_model, ref_optimizer) = make(), make()
    lifted, reference, x = ml.jit(step), nnx.jit(step), jnp.ones((2, 4))
    for _ in range(3):
        np.testing.assert_allclose(
            lifted(model, optimizer, x), reference(ref_model, ref_optimizer, x), rtol=1e-6
        )
    np.testing.assert_allclose(model.kernel[...], ref_model.kernel[...], rtol=1e-6)


class Holder:
    """A plain object: what a module holds of it is static."""


def test_a_traced_value_stored_in_a_static_value_is_refused_naming_its_path():
    model = nnx.Module()
    model.box, model.w = Holder(), nnx.Param(jnp.ones(2))

    def store(m, x):
        m.box.cache = nnx.Param(2 * x)  # a tracer, in an object no output carries back
        return x

    with pytest.raises(ml.TraceLeakError, match=r"stored a traced value at `m\.box\.cache`"):
        ml.jit(store)(model, jnp.ones(2))
    assert vars(model.box) == {}  # undone: nothing leaked


def test_a_stored_tracer_is_refused_as_jax_refuses_reading_one():
    """JAX raises UnexpectedTracerError where a leaked tracer is read; the refusal is one."""

    class Box:
        pass

    class Holder(nnx.Module):
        def __init__(self):
            self.box = Box()
            self.w = nnx.Param(jnp.ones(3))

    def store(m, x):
        m.box.v = x * 2
        return m.w[...] * x

    holder = Holder()
    with pytest.raises(jax.errors.UnexpectedTracerError, match=r"`m\.box\.v`") as error:
        ml.jit(store)(holder, jnp.ones(3))
    assert isinstance(error.value, ml.TraceLeakError) and not hasattr(holder.box, "v")
    assert "docs.jax.dev" not in str(error.value)
