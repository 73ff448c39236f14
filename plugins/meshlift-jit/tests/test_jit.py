"""ml.jit: numbers, shardings, write-back, options and stages on 8 CPU devices."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.testing.models import graph_mode_jit


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(jax.nn.relu(self.linear1(x)))


TENSOR_PARALLEL = ml.StateSharding(
    {
        ml.path_endswith("linear1", "kernel"): P(None, "model"),
        ml.path_endswith("linear1", "bias"): P("model"),
        ml.path_endswith("linear2", "kernel"): P("model", None),
        ...: P(),
    }
)


def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def data(batch: int = 8, width: int = 16):
    x = jax.random.normal(jax.random.key(1), (batch, width))
    y = jax.random.normal(jax.random.key(2), (batch, width))
    return x, y


def fresh(seed: int = 0):
    model = MLP(16, 32, 16, nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def max_abs_diff(a, b) -> float:
    leaves_a, leaves_b = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(leaves_a, leaves_b, strict=True))


def tensor_parallel_step(mesh):
    specs = (TENSOR_PARALLEL, TENSOR_PARALLEL, P("data"), P("data"))
    return ml.jit(train_step, in_shardings=specs, out_shardings=P(), mesh=mesh)


def test_tensor_parallel_adam_matches_single_device_and_the_plan(mesh):
    x, y = data()
    model, opt = fresh()
    step = tensor_parallel_step(mesh)
    ref_model, ref_opt = fresh()
    ref_step = graph_mode_jit(train_step)  # plain flax, one device
    for _ in range(5):
        loss = step(model, opt, x, y)
        ref_loss = ref_step(ref_model, ref_opt, x, y)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5
    assert max_abs_diff(model, ref_model) <= 1e-5
    assert int(opt.step[...]) == 5
    expected = {
        ("linear1", "kernel"): P(None, "model"),
        ("linear1", "bias"): P("model"),
        ("linear2", "kernel"): P("model", None),
        ("linear2", "bias"): P(),
    }
    for (layer, name), spec in expected.items():
        param = getattr(getattr(model, layer), name)[...]
        assert param.sharding == NamedSharding(mesh, spec), (layer, name)
        mu = opt.opt_state[0].mu[layer][name][...]
        assert mu.sharding.spec == spec, ("mu", layer, name)


def test_fresh_optimizer_of_same_structure_does_not_retrace(mesh):
    traces = []

    def counted(model, optimizer, x, y):
        traces.append(1)
        return train_step(model, optimizer, x, y)

    step = ml.jit(counted)
    x, y = data()
    model, opt = fresh()
    step(model, opt, x, y)
    step(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), x, y)
    assert len(traces) == 1
    step(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), x, y)
    assert len(traces) == 2  # a different learning rate is a different program
    other_model, other_opt = fresh(seed=3)
    step(other_model, other_opt, x, y)
    assert len(traces) == 2  # another model of the same structure reuses the trace


def test_updates_land_on_the_callers_objects():
    x, y = data()
    model, opt = fresh()
    kernel = model.linear1.kernel
    before = np.asarray(kernel[...])
    ml.jit(train_step)(model, opt, x, y)
    assert model.linear1.kernel is kernel
    assert not np.allclose(before, kernel[...])
    assert int(opt.step[...]) == 1


def test_replacing_a_submodule_between_calls_uses_the_new_one():
    model, _ = fresh()
    forward = ml.jit(lambda m, x: m(x))
    x, _ = data()
    forward(model, x)
    model.linear2 = nnx.Linear(32, 16, rngs=nnx.Rngs(7))
    np.testing.assert_allclose(forward(model, x), model(x), rtol=1e-6)


def test_structure_change_inside_is_carried_back_as_under_nnx_jit():
    def grow(m, x):
        m.linear1.kernel[...] = m.linear1.kernel[...] * 0
        m.extra = nnx.Param(jnp.ones(3))
        return x

    model, reference = fresh()[0], fresh()[0]
    ml.jit(grow)(model, jnp.ones(2))
    graph_mode_jit(grow)(reference, jnp.ones(2))
    np.testing.assert_array_equal(model.extra[...], reference.extra[...])
    np.testing.assert_array_equal(model.linear1.kernel[...], reference.linear1.kernel[...])


def test_exception_inside_leaves_the_model_unchanged():
    model, opt = fresh()

    def fails(m, o):
        m.linear1.kernel[...] = m.linear1.kernel[...] + 1
        raise ValueError("inside")

    before = np.asarray(model.linear1.kernel[...])
    with pytest.raises(ValueError, match="inside"):
        ml.jit(fails)(model, opt)
    np.testing.assert_array_equal(before, model.linear1.kernel[...])


def test_batchnorm_statistics_and_dropout_rng_are_written_back():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.linear(x)))

    net, ref = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
    x = jax.random.normal(jax.random.key(0), (8, 4))
    step = ml.jit(lambda n, x: n(x))
    for _ in range(2):
        np.testing.assert_allclose(step(net, x), ref(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.bn.mean[...], ref.bn.mean[...], rtol=1e-6)
    assert int(net.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 2


def test_shared_variables_stay_shared():
    class Tied(nnx.Module):
        def __init__(self):
            self.embed = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.head = self.embed

    tied = Tied()
    before = np.asarray(tied.embed.kernel[...])

    def double(t):
        t.head.kernel[...] = t.embed.kernel[...] * 2

    ml.jit(double)(tied)
    assert tied.head is tied.embed
    np.testing.assert_allclose(tied.embed.kernel[...], before * 2)


def test_shared_variable_sharded_two_ways_names_both_paths(mesh):
    class Tied(nnx.Module):
        def __init__(self):
            self.embed = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
            self.head = self.embed

    plan = ml.StateSharding(
        {
            ml.path_endswith("embed", "kernel"): P(None, "model"),
            ml.path_endswith("head", "kernel"): P("model", None),
            ...: P(),
        }
    )
    with pytest.raises(ml.PlanError, match=r"`t\.embed\.kernel` and `t\.head\.kernel`"):
        ml.jit(lambda t: None, in_shardings=(plan,), mesh=mesh)(Tied())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (P("nope"), "mesh axis 'nope' is not in the mesh"),
        (P(None, ("data", "model")), "not divisible by 8"),
        (P("model", "model"), "used twice"),
        (P(None, None, "data"), "has rank 2"),
    ],
)
def test_bad_plan_errors_name_path_shape_spec_and_mesh(mesh, spec, message):
    model = MLP(16, 12, 16, nnx.Rngs(0))  # linear1.kernel is (16, 12)
    plan = ml.StateSharding({ml.path_endswith("linear1", "kernel"): spec, ...: P()})
    step = ml.jit(lambda model, x: model(x), in_shardings=(plan, None), mesh=mesh)
    with pytest.raises(ml.PlanError) as info:
        step(model, jnp.ones((2, 16)))
    text = str(info.value)
    assert "`model.linear1.kernel`" in text and "(16, 12)" in text
    assert str(spec) in text and "{'data': 2, 'model': 4}" in text and message in text


def test_unmatched_parameter_names_its_path(mesh):
    plan = ml.StateSharding({ml.path_endswith("linear1", "kernel"): P(None, "model")})
    model, _ = fresh()
    with pytest.raises(ml.PlanError, match=r"`linear1.bias`.*\.\.\.: P\(\)"):
        ml.jit(lambda m: None, in_shardings=(plan,), mesh=mesh)(model)


def test_bare_spec_without_a_mesh_says_how_to_give_one():
    with pytest.raises(ml.PlanError, match=r"ml\.use_mesh"):
        ml.jit(lambda x: x, in_shardings=P("data"))(jnp.ones(8))


def test_use_mesh_supplies_the_mesh_and_refuses_committed_inputs_as_jax_jit_does(mesh):
    model, _ = fresh()
    x = jnp.ones((8, 16))
    forward = ml.transform(
        "jit", lambda m, x: m(x), in_specs=(TENSOR_PARALLEL, P("data")), out_specs=P("data")
    )
    with ml.use_mesh(mesh):
        committed = jnp.ones((8, 16))  # made under the mesh: committed, replicated
        with pytest.raises(ValueError, match="does not match the sharding"):
            jax.jit(lambda x: x, in_shardings=P("data"))(committed)
        with pytest.raises(ValueError, match=r"`x` \(shape \(8, 16\)\) is committed to"):
            forward(model, committed)
        out = forward(model, x)
        placed = forward(model, jax.device_put(committed, NamedSharding(mesh, P("data"))))
    assert out.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(out, placed)
    assert model.linear1.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))


def test_init_with_a_plan_for_the_output_module(mesh):
    init = ml.jit(lambda: MLP(16, 32, 16, nnx.Rngs(0)), out_shardings=TENSOR_PARALLEL, mesh=mesh)
    model = init()
    reference = MLP(16, 32, 16, nnx.Rngs(0))
    assert isinstance(model, MLP)
    assert model.linear1.kernel[...].sharding.spec == P(None, "model")
    assert model.linear2.kernel[...].sharding.spec == P("model", None)
    assert max_abs_diff(model, reference) == 0.0


def test_returning_an_argument_gives_back_the_same_object():
    model, _ = fresh()
    assert ml.jit(lambda m: m)(model) is model


def test_eval_shape_gives_abstract_modules_and_writes_nothing():
    model, _ = fresh()
    before = np.asarray(model.linear1.kernel[...])

    def bump_and_make(m):
        m.linear1.kernel[...] += 1
        return nnx.Linear(3, 5, rngs=nnx.Rngs(0)), m(jnp.ones((2, 16)))

    layer, out = ml.jit(bump_and_make).eval_shape(model)
    assert layer.kernel.get_value() == jax.ShapeDtypeStruct((3, 5), jnp.float32)
    assert out.shape == (2, 16)
    np.testing.assert_array_equal(before, model.linear1.kernel[...])


def test_decorator_forms_and_static_arguments():
    @ml.jit
    def plain(x):
        return x + 1

    @ml.jit(static_argnums=1)
    def scaled(x, n):
        return x * n

    @ml.jit(static_argnames="n")
    def scaled_kw(x, *, n):
        return x * n

    assert float(plain(jnp.float32(1))) == 2.0
    assert float(scaled(jnp.float32(2), 3)) == 6.0
    assert float(scaled_kw(jnp.float32(2), n=4)) == 8.0
    with pytest.raises(ValueError, match="static argument n must be hashable"):  # as jax.jit
        scaled(jnp.float32(2), [3])


def test_donated_model_buffers_are_reused_and_written_back():
    model, opt = fresh()
    x, y = data()
    old = model.linear1.kernel[...]
    step = ml.jit(train_step, donate_argnums=(0, 1))
    step(model, opt, x, y)
    assert old.is_deleted()
    assert not model.linear1.kernel[...].is_deleted()
    step(model, opt, x, y)
    assert int(opt.step[...]) == 2


def test_donate_argnames_and_keep_unused():
    step = ml.jit(lambda a, unused: a * 2, donate_argnames="a", keep_unused=True)
    a = jnp.ones(4)
    lowered = step.lower(a, jnp.ones(3))
    assert "tensor<3xf32>" in lowered.as_text()  # kept although unused
    np.testing.assert_array_equal(step(a, jnp.ones(3)), 2 * np.ones(4))
    assert a.is_deleted()


def test_works_as_a_method():
    class Counter(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(3))

        @ml.jit
        def add(self, x):
            self.total[...] += x
            return self.total[...].sum()

    counter = Counter()
    counter.add(jnp.ones(3))
    assert float(counter.add(jnp.ones(3))) == 6.0
    np.testing.assert_array_equal(counter.total[...], 2 * np.ones(3))


def test_stages_lower_compile_and_call_with_modules(mesh):
    x, y = data()
    model, opt = fresh()
    step = tensor_parallel_step(mesh)
    traced = step.trace(model, opt, x, y)
    assert "dot_general" in str(traced.jaxpr)
    lowered = traced.lower()
    assert "sdy.sharding" in lowered.as_text() or "mhlo.sharding" in lowered.as_text()
    compiled = lowered.compile()
    assert "all-reduce" in compiled.as_text()
    assert compiled.cost_analysis()["flops"] > 0
    assert compiled.memory_analysis() is not None
    kernel_sharding = NamedSharding(mesh, P(None, "model"))
    assert kernel_sharding in jax.tree.leaves(compiled.input_shardings)
    before = int(opt.step[...])
    loss = compiled(model, opt, x, y)
    assert loss.shape == () and int(opt.step[...]) == before + 1
    assert step.lower(model, opt, x, y).compile()(model, opt, x, y).shape == ()


def test_stages_speak_in_the_callers_arguments(mesh):
    x, y = data()
    model, opt = fresh()
    lowered = tensor_parallel_step(mesh).lower(model, opt, x, y)
    (model_avals, _, x_aval, y_aval), kwargs = lowered.in_avals
    assert kwargs == {}
    assert isinstance(model_avals, nnx.State)
    assert model_avals["linear1"]["kernel"].shape == (16, 32)
    assert (x_aval.shape, y_aval.shape) == (x.shape, y.shape)
    assert lowered.args_info[0][2].donated is False
    compiled = lowered.compile()
    (model_shardings, opt_shardings, x_sharding, _), _ = compiled.input_shardings
    assert model_shardings["linear1"]["kernel"] == NamedSharding(mesh, P(None, "model"))
    assert opt_shardings["opt_state"][0]["mu"]["linear2"]["kernel"].spec == P("model", None)
    assert x_sharding.spec == P("data")
    assert compiled.output_shardings.is_fully_replicated  # the loss, as out_shardings=P()
    assert compiled.out_info.shape == ()


def test_compiled_takes_only_the_dynamic_arguments_as_jax_compiled_does():
    def scale(x, k):
        return x * k

    x = jnp.arange(4.0)
    reference = jax.jit(scale, static_argnums=1).lower(x, 3).compile()
    compiled = ml.jit(scale, static_argnums=1).lower(x, 3).compile()
    np.testing.assert_array_equal(compiled(x), reference(x))
    assert compiled.in_avals == reference.in_avals
    with pytest.raises(TypeError, match=r"static arguments \(k\) are not passed again"):
        compiled(x, 3)
    named = ml.jit(scale, static_argnames="k").lower(x, k=2).compile()
    np.testing.assert_array_equal(named(x), x * 2)


def test_jax_errors_name_the_callers_arguments_not_the_staged_inputs():
    model, _ = fresh()

    def branch_on_data(m, x):
        return m(x) if x.sum() > 0 else x

    def branch_on_a_parameter(m, x):
        return m(x) if m.linear1.kernel[0, 0] > 0 else x

    x = jnp.ones((2, 16))
    for fn, name in ((branch_on_data, "x"), (branch_on_a_parameter, "m.linear1.kernel")):
        for stage in (ml.jit(fn), ml.jit(fn).lower):
            with pytest.raises(jax.errors.TracerBoolConversionError) as info:
                stage(model, x)
            message = str(info.value)  # JAX's own words, with the function's own name
            assert f"tracing the function {fn.__name__} at {__file__}" in message
            assert f"depends on the value of the argument {name}.\n" in message


def test_wrapping_a_function_again_shares_its_programs_and_drops_them_with_it():
    traces = []

    def double(x):
        traces.append(1)
        return x * 2

    x = jnp.ones(4)
    for _ in range(3):
        ml.jit(double)(x)
    ml.jit(double, donate_argnums=0)(jnp.ones(4))  # other options: another program
    assert len(traces) == 2
    collected = []
    weakref.finalize(double, collected.append, True)
    del double
    gc.collect()
    assert collected == [True]  # the shared cache does not keep the function alive


def test_compiled_rejects_arguments_of_another_structure():
    compiled = ml.jit(lambda m: m(jnp.ones((1, 16)))).lower(fresh()[0]).compile()
    with pytest.raises(TypeError, match="compile"):
        compiled(MLP(16, 8, 16, nnx.Rngs(0)))


def test_jit_options_reach_jax():
    cpu = jax.devices()[3]
    with pytest.warns(DeprecationWarning, match="backend and device argument on jit"):
        out = ml.jit(lambda x: x + 1, device=cpu)(jnp.ones(2))
        assert out.devices() == {cpu}
        lowered = ml.jit(lambda x: x * 2, inline=True, backend="cpu").lower(jnp.ones(2))
    np.testing.assert_array_equal(lowered.compile()(jnp.ones(2)), [2.0, 2.0])
    with pytest.raises(ValueError, match="device= and backend= cannot be combined"):
        ml.jit(lambda x: x, device=cpu, in_shardings=P(), mesh=ml.make_mesh({"d": 8}))(jnp.ones(8))
    options = {"xla_embed_ir_in_executable": True}
    lowered = ml.jit(lambda x: x * 2, compiler_options=options).lower(jnp.ones(2))
    np.testing.assert_array_equal(lowered.compile()(jnp.ones(2)), [2.0, 2.0])


def test_transform_jit_is_the_same_backend(mesh):
    x, y = data()
    a_model, a_opt = fresh()
    b_model, b_opt = fresh()
    specs = (TENSOR_PARALLEL, TENSOR_PARALLEL, P("data"), P("data"))
    by_name = ml.transform("jit", train_step, mesh=mesh, in_specs=specs, out_specs=P())
    by_object = ml.transform(ml.get_backend("jit"), train_step, mesh=mesh, in_specs=specs)
    assert float(by_name(a_model, a_opt, x, y)) == float(by_object(b_model, b_opt, x, y))
    assert max_abs_diff(a_model, b_model) == 0.0
    assert "jit" in [b.name for b in ml.backends()]


def test_a_first_call_under_an_outer_trace_leaks_no_tracer(mesh):
    model, _ = fresh()
    x, _ = data()
    forward = ml.jit(lambda m, x: m(x), in_shardings=(TENSOR_PARALLEL, P("data")), mesh=mesh)
    jax.make_jaxpr(jax.grad(lambda x: forward(model, x).sum()))(x)  # binds inside a trace
    assert isinstance(model.linear1.kernel.get_value(), jax.Array)
    assert not isinstance(model.linear1.kernel.get_value(), jax.core.Tracer)
    np.testing.assert_allclose(forward(model, x), model(x), rtol=1e-5, atol=1e-6)


def _ref_cases():
    """Three uses of `ref=True` Variables: updated, shared by two attributes, passed twice.

    Each case: the function, and a maker of fresh arguments and of their Variables.
    """

    def update(m):
        m.p[...] = m.p[...] + 1
        return m.p[...].sum()

    def shared(m):
        m.a[...] = m.a[...] * 2
        return m.b[...]

    def twice(a, b):
        a[...] = a[...] + 1
        return b[...]

    def one_param():
        m = nnx.Module()
        m.p = nnx.Param(jnp.ones((3,)), ref=True)
        return (m,), [m.p]

    def tied():
        m, v = nnx.Module(), nnx.Param(jnp.ones((3,)), ref=True)
        m.a = m.b = v
        return (m,), [m.a, m.b]

    def same_twice():
        v = nnx.Param(jnp.ones((3,)), ref=True)
        return (v, v), [v]

    return [(update, one_param), (shared, tied), (twice, same_twice)]


@pytest.mark.parametrize("case, fresh", _ref_cases(), ids=["update", "shared", "twice"])
def test_ref_variables_behave_as_under_nnx_jit(case, fresh):
    (ours, our_vars), (theirs, their_vars) = fresh(), fresh()
    lifted, reference = ml.jit(case), graph_mode_jit(case)
    for _ in range(2):  # the second call reuses the compiled program
        np.testing.assert_array_equal(lifted(*ours), reference(*theirs))
        for mine, flax_one in zip(our_vars, their_vars, strict=True):
            np.testing.assert_array_equal(mine[...], flax_one[...])
    assert our_vars[0][...][0] > 1  # updated in place, through the reference


def test_hijax_variables_are_refused_by_path_and_left_alone():
    model = nnx.Module()
    model.p = nnx.Param(jnp.ones((3,)), hijax=True)

    def step(m):
        m.p[...] = m.p[...] + 1

    with pytest.raises(ml.PlanError, match=r"`m.p` is a hijax Variable .*ref=True"):
        ml.jit(step)(model)
    np.testing.assert_array_equal(model.p[...], jnp.ones((3,)))
    with pytest.raises(ml.PlanError, match=r"`v` is a hijax Variable"):
        ml.jit(lambda v: v[...] * 2)(model.p)


def test_flaxs_own_state_sharding_in_in_shardings_places_as_under_nnx_jit(mesh):
    """`nnx.StateSharding`, flax's plan object, where `nnx.jit` takes it (issue 27)."""

    def step(model, x):
        model.bias[...] += 1
        return model(x)

    results = {}
    for name, transform in (("nnx.jit", graph_mode_jit), ("ml.jit", ml.jit)):
        model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        plan = nnx.StateSharding(
            {
                nnx.PathContains("kernel"): NamedSharding(mesh, P(None, "model")),
                ...: NamedSharding(mesh, P()),
            }
        )
        out = transform(step, in_shardings=(plan, NamedSharding(mesh, P("data"))))(
            model, jnp.ones((4, 8))
        )
        results[name] = (out, model)
    (ref_out, ref), (out, model) = results["nnx.jit"], results["ml.jit"]
    np.testing.assert_allclose(out, ref_out)
    for got, want in ((model.kernel, ref.kernel), (model.bias, ref.bias)):
        assert got[...].sharding.spec == want[...].sharding.spec
        np.testing.assert_allclose(got[...], want[...])
    assert model.kernel[...].sharding.spec == P(None, "model")


def test_explain_takes_flaxs_state_sharding(mesh):
    plan = nnx.StateSharding({nnx.PathContains("kernel"): P(None, "model"), ...: P()})
    report = ml.explain(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), plan, mesh)
    assert {r.path: r.spec for r in report.rows} == {"bias": P(), "kernel": P(None, "model")}


class PytreeHolder(nnx.Module):
    def __init__(self, first=4):
        self.tree = nnx.Variable({"a": jnp.ones(first), "b": [jnp.zeros(8)]})


def test_a_plan_on_a_variable_holding_a_pytree_shards_each_array_as_nnx_jit(mesh):
    """A Variable holding a pytree (issue 27): the spec applies to each of its arrays."""

    def step(holder):
        holder.tree.set_value(jax.tree.map(lambda x: x + 1, holder.tree.get_value()))
        return holder.tree.get_value()["a"].sum()

    sharded = NamedSharding(mesh, P("model"))
    results = {}
    for name, lifted in (
        ("nnx.jit", graph_mode_jit(step, in_shardings=(nnx.StateSharding({...: sharded}),))),
        ("ml.jit", ml.jit(step, in_shardings=(ml.StateSharding({...: P("model")}),), mesh=mesh)),
    ):
        holder = PytreeHolder()
        results[name] = ([float(lifted(holder)) for _ in range(2)], holder)
    (ref_out, ref), (out, holder) = results["nnx.jit"], results["ml.jit"]
    assert out == ref_out == [8.0, 12.0]
    got, want = holder.tree.get_value(), ref.tree.get_value()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
        assert g.sharding.spec == P("model")
    report = ml.explain(holder, ml.StateSharding({...: P("model")}), mesh)
    assert {r.path: r.shape for r in report.rows} == {"tree.a": (4,), "tree.b.0": (8,)}


def test_a_pytree_variables_array_the_mesh_cannot_shard_is_named(mesh):
    step = ml.jit(lambda h: h.tree.get_value()["a"].sum(), in_shardings=(P("model"),), mesh=mesh)
    with pytest.raises(ml.PlanError, match=r"`h\.tree\.a` \(shape \(3,\)\).*not divisible by 4"):
        step(PytreeHolder(first=3))


def test_nnx_jits_graph_options_true_is_what_meshlift_does_false_is_refused():
    def step(model):
        model.count = nnx.Variable(jnp.zeros(()))  # a structure change, carried back
        return model.bias[...].sum()

    for lifted in (graph_mode_jit(step), ml.jit(step, graph=True, graph_updates=True)):
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        lifted(model)
        assert isinstance(model.count, nnx.Variable)
    for option in ("graph", "graph_updates"):
        with pytest.raises(ValueError, match=f"{option}=False asks for flax's tree mode"):
            ml.jit(step, **{option: False})
