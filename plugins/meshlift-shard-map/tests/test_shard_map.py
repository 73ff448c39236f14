"""ml.shard_map on 8 CPU devices: flax's examples, write-back, meshes, options, stages, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.testing import models as M
from meshlift.testing.models import graph_mode_jit
from meshlift_shard_map import AxisNameError


@pytest.fixture(scope="module")
def data_mesh():
    return ml.make_mesh({"data": 8})


@pytest.fixture(scope="module")
def model_mesh():
    return ml.make_mesh({"model": 8})


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


# -- flax's nnx.shard_map docstring examples, with meshlift names ---------------------------


class MLP(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, use_bias=False, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jax.nn.relu(self.linear1(x)))


def test_flax_example_data_parallel(data_mesh):
    m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (32, 2))

    @ml.shard_map(mesh=data_mesh, in_specs=(P(None), P("data")), out_specs=P("data"))
    def f(m, x):
        assert x.shape == (4, 2)  # one device's rows
        return m(x)

    y = f(m, x)
    assert y.sharding == NamedSharding(data_mesh, P("data"))
    np.testing.assert_allclose(y, m(x), rtol=1e-6)


def tensor_parallel_forward(m, x):
    return jax.lax.psum(m(x), "model")


def test_flax_example_tensor_parallel_with_path_filters(model_mesh):
    m = MLP(2, 64, 3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (32, 2))
    expected = m(x)
    model_spec = ml.StateSharding(
        {
            ml.path_endswith("linear1", "kernel"): P(None, "model"),
            ml.path_endswith("linear2", "kernel"): P("model", None),
        }
    )
    f = ml.shard_map(
        tensor_parallel_forward, mesh=model_mesh, in_specs=(model_spec, P(None)), out_specs=P(None)
    )
    np.testing.assert_allclose(f(m, x), expected, rtol=1e-5, atol=1e-6)
    assert m.linear1.kernel[...].sharding == NamedSharding(model_mesh, P(None, "model"))
    assert m.linear2.kernel[...].sharding == NamedSharding(model_mesh, P("model", None))


@pytest.mark.parametrize("wrap", [ml.StateSharding.from_state, lambda state: state])
def test_flax_example_tensor_parallel_with_a_state_of_specs(model_mesh, wrap):
    m = MLP(2, 64, 3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (32, 2))
    expected = m(x)
    model_spec = nnx.State(
        {"linear1": {"kernel": P(None, "model")}, "linear2": {"kernel": P("model", None)}}
    )
    f = ml.shard_map(
        tensor_parallel_forward,
        mesh=model_mesh,
        in_specs=(wrap(model_spec), P(None)),
        out_specs=P(None),
    )
    np.testing.assert_allclose(f(m, x), expected, rtol=1e-5, atol=1e-6)
    assert m.linear2.kernel[...].sharding.spec == P("model", None)


# -- write-back ------------------------------------------------------------------------------


def test_batchnorm_statistics_are_averaged_and_written_back(data_mesh):
    sharded, single = (nnx.BatchNorm(4, axis_name=a, rngs=nnx.Rngs(0)) for a in ("data", None))
    x = jax.random.normal(jax.random.key(0), (32, 4)) * 3 + 1
    f = ml.shard_map(
        lambda bn, x: bn(x), mesh=data_mesh, in_specs=(P(), P("data")), out_specs=P("data")
    )
    for _ in range(2):
        np.testing.assert_allclose(f(sharded, x), single(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sharded.mean[...], single.mean[...], rtol=1e-5)
    np.testing.assert_allclose(sharded.var[...], single.var[...], rtol=1e-5)
    assert float(jnp.abs(sharded.mean[...]).min()) > 0  # the statistics did move
    assert sharded.mean[...].sharding == NamedSharding(data_mesh, P())


def test_sharded_state_is_written_back_with_its_spec(mesh):
    counter = nnx.Variable(jnp.arange(8.0))
    bump = ml.shard_map(
        lambda v: v.__setitem__(..., v[...] + jax.lax.axis_index("model")),
        mesh=mesh,
        in_specs=P("model"),
        out_specs=None,
    )
    bump(counter)
    np.testing.assert_array_equal(counter[...], np.arange(8.0) + np.repeat(np.arange(4), 2))
    assert counter[...].sharding == NamedSharding(mesh, P("model"))


# -- check_vma: the gradient through a row-parallel psum ---------------------------------


def row_parallel_grads(check_vma: bool, **kwargs):
    """Gradients of sum(psum(relu(x @ up) @ down)^2) per shard, on a 4-device 'model' mesh."""
    mesh = ml.make_mesh({"model": 4}, devices=jax.devices()[:4])
    model = MLP(8, 16, 8, rngs=nnx.Rngs(0))
    plan = ml.StateSharding(
        {
            ml.path_endswith("linear1", "kernel"): P(None, "model"),
            ml.path_endswith("linear2", "kernel"): P("model", None),
        }
    )
    x = jax.random.normal(jax.random.key(0), (4, 8))

    def grads(model, x):
        g = nnx.grad(lambda m: jnp.sum(jax.lax.psum(m(x), "model") ** 2))(model)
        return g["linear1"]["kernel"][...], g["linear2"]["kernel"][...]

    f = ml.shard_map(
        grads,
        mesh=mesh,
        in_specs=(plan, P()),
        out_specs=(P(None, "model"), P("model", None)),
        check_vma=check_vma,
        **kwargs,
    )
    expected = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)  # one device, no shard_map
    return f(model, x), (expected["linear1"]["kernel"][...], expected["linear2"]["kernel"][...])


def test_check_vma_default_gives_the_single_device_gradient():
    got, expected = row_parallel_grads(check_vma=True)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_without_check_vma_gradients_upstream_of_psum_are_scaled_by_the_axis_size():
    got, expected = row_parallel_grads(check_vma=False)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, 4 * e, rtol=1e-5, atol=1e-5)  # silently 4x


# -- meshes ----------------------------------------------------------------------------------


def test_abstract_mesh_resolves_against_the_call_site_mesh(mesh):
    abstract = AbstractMesh((2, 4), ("data", "model"))
    f = ml.shard_map(lambda x: x * 2, mesh=abstract, in_specs=P("data"), out_specs=P("data"))
    x = jnp.arange(8.0)  # made outside: inside ml.use_mesh it would be committed, replicated
    with ml.use_mesh(mesh):
        y = f(x)
    assert y.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(y, 2 * np.arange(8.0))
    with pytest.raises(ValueError, match=r"abstract mesh .* found no mesh.*ml\.use_mesh"):
        f(jnp.arange(8.0))
    with ml.use_mesh(ml.make_mesh({"data": 8})), pytest.raises(ValueError, match="'data': 8"):
        f(jnp.arange(8.0))


def test_omitted_mesh_is_the_use_mesh_mesh(mesh, data_mesh):
    f = ml.shard_map(lambda x: x.sum(keepdims=True), in_specs=P("data"), out_specs=P("data"))
    x = jnp.arange(8.0)
    with ml.use_mesh(mesh):
        assert f(x).shape == (2,)  # two shards along 'data': 2
    with ml.use_mesh(data_mesh):
        assert f(x).shape == (8,)  # same function, another mesh
    with pytest.raises(ml.PlanError, match=r"ml\.use_mesh"):
        f(jnp.arange(8.0))


# -- legacy names ------------------------------------------------------------------------


def test_check_rep_is_the_deprecated_name_of_check_vma():
    with pytest.warns(DeprecationWarning, match="check_rep= is deprecated.*check_vma"):
        got, expected = row_parallel_grads(check_vma=True, check_rep=False)
    np.testing.assert_allclose(got[0], 4 * expected[0], rtol=1e-5)  # check_vma is off
    with pytest.raises(TypeError, match="pass only check_vma"):
        ml.shard_map(
            lambda x: x, mesh=None, in_specs=P(), out_specs=P(), check_vma=False, check_rep=True
        )


def test_auto_leaves_axes_to_the_compiler(mesh):
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    x = jax.random.normal(jax.random.key(0), (8, 16))
    expected = model(x)
    with pytest.warns(DeprecationWarning, match="auto= is deprecated.*axis_names"):
        f = ml.shard_map(
            lambda m, x: m(x),
            mesh=mesh,
            in_specs=(plan, P("data")),
            out_specs=P("data"),
            auto={"model"},
        )
    np.testing.assert_allclose(f(model, x), expected, rtol=1e-5, atol=1e-6)
    # 'model' stays the compiler's: the kernel keeps its plan sharding
    assert model.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    with pytest.warns(DeprecationWarning):
        g = ml.transform(
            "shard_map",
            lambda x: jax.lax.psum(x, "model"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            auto=("model",),
        )
        with pytest.raises(AxisNameError, match=r"'model'.*manual axes \['data'\]"):
            g(jnp.ones(8))


@pytest.mark.parametrize("axis_names", [None, {"data"}], ids=["fully-manual", "data-manual"])
@pytest.mark.parametrize("context", ["use_mesh", "mesh="])
def test_with_logical_constraint_inside_constrains_the_auto_axes_as_jax_does(
    mesh, axis_names, context
):
    """A model written with logical constraints runs under shard_map (issue 27): the manual
    axes are split already, the auto ones are constrained as `with_sharding_constraint` does."""
    rules = [("batch", "data"), ("embed", "model")]
    options = {} if axis_names is None else {"axis_names": axis_names}

    def body(constrain):
        return lambda m, x: constrain(m(x))

    def run(constrain):
        model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
        f = ml.shard_map(
            body(constrain),
            mesh=None if context == "use_mesh" else mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
            **options,
        )
        with ml.axis_rules(rules):
            if context == "use_mesh":
                with ml.use_mesh(mesh):
                    return f(model, x)
            return f(model, x)

    ours = run(lambda y: ml.with_logical_constraint(y, ("batch", "embed")))
    auto_spec = P() if axis_names is None else P(None, "model")  # 'data' is manual
    theirs = run(lambda y: jax.lax.with_sharding_constraint(y, auto_spec))
    np.testing.assert_array_equal(ours, theirs)
    assert ours.sharding == theirs.sharding


# -- arguments, forms, stages ------------------------------------------------------------


def test_static_arguments_and_keywords(data_mesh):
    @ml.shard_map(mesh=data_mesh, in_specs=(P("data"),), out_specs=P("data"), static_argnums=1)
    def scaled(x, n, *, offset=0.0):
        return x * n + offset

    @ml.shard_map(mesh=data_mesh, in_specs=P("data"), out_specs=P("data"), static_argnames="n")
    def scaled_kw(x, *, n):
        return x * n

    x = jnp.arange(8.0)
    np.testing.assert_array_equal(scaled(x, 3), 3 * np.arange(8.0))
    np.testing.assert_array_equal(scaled_kw(x, n=4), 4 * np.arange(8.0))
    with pytest.raises(ValueError, match=r"keyword argument.* offset"):  # a keyword takes no spec
        scaled(x, 3, offset=1.0)
    with pytest.raises(ValueError, match="static argument n must be hashable"):  # as jax.jit
        scaled(x, [3])


def test_donated_model_buffers_are_reused_and_written_back(data_mesh):
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    old = model.kernel[...]
    expected = np.asarray(old) * 2

    def double(m):
        m.kernel[...] = m.kernel[...] * 2

    f = ml.shard_map(double, mesh=data_mesh, in_specs=P(), out_specs=None, donate_argnums=0)
    f(model)  # the kernel is placed onto the mesh, a copy: something else may hold `old`
    placed = model.kernel[...]
    assert not old.is_deleted()
    np.testing.assert_array_equal(placed, expected)
    f(model)
    assert placed.is_deleted()
    np.testing.assert_array_equal(model.kernel[...], expected * 2)
    with pytest.raises(ValueError, match="donation needs the enclosing jit"):
        ml.shard_map(
            double, mesh=data_mesh, in_specs=P(), out_specs=None, donate_argnums=0, jit=False
        )(model)


def test_without_jit_each_call_traces_and_gives_the_same_numbers(data_mesh):
    traces = []

    def f(x):
        traces.append(1)
        return jax.lax.psum(x, "data")

    x = jnp.arange(8.0)
    eager = ml.shard_map(f, mesh=data_mesh, in_specs=P("data"), out_specs=P(), jit=False)
    jitted = ml.shard_map(f, mesh=data_mesh, in_specs=P("data"), out_specs=P())
    for _ in range(2):
        np.testing.assert_array_equal(eager(x), jitted(x))
    assert len(traces) == 3  # eager traced twice, the jitted one once


def test_works_as_a_method(data_mesh):
    class Counter(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(()))

        @ml.shard_map(mesh=data_mesh, in_specs=(P(), P("data")), out_specs=P())
        def add(self, x):
            self.total[...] += jax.lax.psum(x.sum(), "data")
            return self.total[...]

    counter = Counter()
    counter.add(jnp.ones(8))
    assert float(counter.add(jnp.ones(8))) == 16.0
    assert float(counter.total[...]) == 16.0


def test_stages_and_compiled_calls_with_modules(mesh):
    model = MLP(16, 32, 16, rngs=nnx.Rngs(0))
    plan = ml.StateSharding(
        {
            ml.path_endswith("linear1", "kernel"): P(None, "model"),
            ml.path_endswith("linear2", "kernel"): P("model", None),
        }
    )
    x = jax.random.normal(jax.random.key(0), (8, 16))
    expected = model(x)

    def forward(m, x):
        m.linear1.kernel[...] *= 1.0  # an update, to be written back by compiled calls
        return tensor_parallel_forward(m, x)

    f = ml.shard_map(forward, mesh=mesh, in_specs=(plan, P("data")), out_specs=P("data"))
    out = f.eval_shape(model, x)
    assert out == jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=out.sharding)
    traced = f.trace(model, x)
    assert isinstance(traced, ml.Traced) and "shard_map" in str(traced.jaxpr)
    lowered = traced.lower()
    assert isinstance(lowered, ml.Lowered)
    assert "sdy.manual_computation" in lowered.as_text() and "all_reduce" in lowered.as_text()
    compiled = lowered.compile()
    assert isinstance(compiled, ml.Compiled) and "all-reduce" in compiled.as_text()
    np.testing.assert_allclose(compiled(model, x), expected, rtol=1e-5, atol=1e-6)
    assert model.linear1.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    np.testing.assert_allclose(
        f.lower(model, x).compile()(model, x), expected, rtol=1e-5, atol=1e-6
    )


def test_transform_by_name_is_the_same_backend(mesh):
    model = MLP(16, 32, 16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 16))
    plan = nnx.State(
        {"linear1": {"kernel": P(None, "model")}, "linear2": {"kernel": P("model", None)}}
    )
    kwargs = dict(mesh=mesh, in_specs=(plan, P("data")), out_specs=P("data"))
    by_name = ml.transform("shard_map", tensor_parallel_forward, **kwargs)
    by_frontend = ml.shard_map(tensor_parallel_forward, **kwargs)
    np.testing.assert_array_equal(by_name(model, x), by_frontend(model, x))
    assert by_name.backend == ml.get_backend("shard_map") == by_frontend.backend
    with pytest.raises(TypeError, match=r"unknown options \['in_shardings'\]"):
        ml.transform("shard_map", tensor_parallel_forward, in_shardings=P(), **kwargs)(model, x)


# -- errors before compiling -----------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (P("nope"), "mesh axis 'nope' is not in the mesh"),
        (P(None, ("data", "model")), "not divisible by 8"),
        (P("model", "model"), "used twice"),
        (P(None, None, "data"), "has rank 2"),
    ],
)
def test_bad_specs_name_the_argument_path_before_tracing(mesh, spec, message):
    model = MLP(16, 12, 16, rngs=nnx.Rngs(0))  # linear1.kernel is (16, 12)
    plan = ml.StateSharding({ml.path_endswith("linear1", "kernel"): spec, ...: P()})
    traced = []
    f = ml.shard_map(
        lambda model, x: traced.append(1) or model(x),
        mesh=mesh,
        in_specs=(plan, P("data")),
        out_specs=P("data"),
    )
    with pytest.raises(ml.PlanError) as info:
        f(model, jnp.ones((8, 16)))
    text = str(info.value)
    assert "`model.linear1.kernel`" in text and "(16, 12)" in text and message in text
    assert not traced


@pytest.mark.parametrize(
    ("axis", "message"),
    [
        ("model", r"names 'model', which is not one of its manual axes \['data'\]"),
        ("nope", r"names an axis, which is not one of its manual axes"),
    ],
)
def test_a_collective_over_a_non_manual_axis_says_how_to_fix_it(mesh, axis, message):
    f = ml.shard_map(
        lambda x: jax.lax.psum(x, axis),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        axis_names={"data"},
    )
    with pytest.raises(AxisNameError, match=message) as info:
        f(jnp.ones(8))
    assert "add the axis to axis_names" in str(info.value)


def test_transform_matches_an_abstract_mesh_and_reads_old_names():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with pytest.warns(DeprecationWarning, match="check_rep= is deprecated"):
        double = ml.transform(
            "shard_map",
            lambda x: x * 2,
            mesh=mesh.abstract_mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            check_rep=True,
        )
    x = jnp.arange(8.0)
    with ml.use_mesh(mesh):
        y = double(x)
    assert y.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(y, 2 * np.arange(8.0))
    with pytest.raises(ValueError, match="needs a device mesh of that shape"):
        double(jnp.arange(8.0))  # no mesh in context


def test_a_plan_for_outputs_with_collectives_says_to_use_specs():
    mesh = ml.make_mesh({"data": 8})
    plan = ml.StateSharding({...: P()})
    f = ml.shard_map(
        lambda x: {"w": jax.lax.psum(x, "data")}, mesh=mesh, in_specs=P("data"), out_specs=plan
    )
    with pytest.raises(ml.PlanError, match="Give out_specs as PartitionSpecs"):
        f(jnp.ones(8))


def test_a_none_in_specs_passes_the_argument_through_as_jax_shard_map_does(mesh):
    def body(x, k, label):
        seen.append((type(k), label))
        return x * k

    x = jnp.arange(8.0)
    seen = []
    expected = jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), None, None), out_specs=P("data")
    )(x, 3, "three")
    reference = list(seen)
    seen.clear()
    lifted = ml.shard_map(body, mesh=mesh, in_specs=(P("data"), None, None), out_specs=P("data"))
    np.testing.assert_array_equal(lifted(x, 3, "three"), expected)
    assert seen == reference == [(int, "three")]  # the Python int itself, never traced
    np.testing.assert_array_equal(lifted(x, 4, "four"), x * 4)  # another value: recompiled
    lifted(x, 3, "three")
    assert len(seen) == 2  # the first program is reused
    with pytest.raises(TypeError, match=r"`label` \(bytearray\) passes through body unchanged"):
        lifted(x, 3, bytearray(b"x"))


def test_a_varying_output_error_names_the_variable_and_the_fix(data_mesh):
    model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
    forward = ml.shard_map(
        lambda m, x: m(x).mean(), mesh=data_mesh, in_specs=(P(), P("data")), out_specs=P()
    )
    before = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    with pytest.raises(ValueError) as info:
        forward(model, jnp.ones((8, 4)))
    message, notes = str(info.value), info.value.__notes__
    staged = re.search(r"(out_specs\[0\]\[\d+\]) is P\(\)", message)  # JAX's own words
    assert staged, message
    assert any(f"{staged.group(1)} is the Variable `m.layers.1.mean`" in n for n in notes)
    assert "out_specs[2] is P()" in message
    assert any("out_specs[2] is the output of <lambda>" in note for note in notes)
    assert any("jax.lax.pmean(value, 'data')" in note for note in notes)
    after = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    assert all(a is b for a, b in zip(before, after, strict=True))  # nothing written


def test_one_tensor_parallel_plan_with_data_manual_and_model_automatic(mesh):
    """axis_names={"data"}: per-shard code over `data` while the compiler keeps the plan's
    `model` sharding of the parameters; numbers equal one program over the whole batch."""
    plan = ml.StateSharding(
        {
            ml.path_endswith("linear1", "kernel"): P(None, "model"),
            ml.path_endswith("linear2", "kernel"): P("model", None),
            ...: P(),
        }
    )

    def make():
        model = MLP(16, 32, 8, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def train_step(model, optimizer, x, y, data_axis=None):
        def loss_fn(model):
            loss = jnp.mean((model(x) - y) ** 2)
            return jax.lax.pmean(loss, data_axis) if data_axis else loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 8))
    step = ml.shard_map(
        lambda m, o, x, y: train_step(m, o, x, y, "data"),
        mesh=mesh,
        in_specs=(plan, plan, P("data"), P("data")),
        out_specs=P(),
        axis_names={"data"},
    )
    reference = graph_mode_jit(train_step)
    ours, theirs = make(), make()
    for _ in range(3):
        np.testing.assert_allclose(step(*ours, x, y), reference(*theirs, x, y), rtol=1e-5)
    for path in (("linear1", "kernel"), ("linear2", "kernel")):
        mine, flax_one = ours[0], theirs[0]
        for name in path:
            mine, flax_one = getattr(mine, name), getattr(flax_one, name)
        np.testing.assert_allclose(mine[...], flax_one[...], rtol=1e-5, atol=1e-6)
        spec = plan.spec_for(path, mine)
        assert mine[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), path


# -- gradient semantics: check_vma decides which step is right (capability vma-gradients) ----


@pytest.mark.parametrize(
    ("check_vma", "sums_gradients", "trains_as_the_reference"),
    [(True, True, True), (False, False, True), (False, True, False)],
    ids=["vma-summing-step", "pmap-era-step", "summing-step-without-vma-is-wrong"],
)
def test_the_kits_step_for_each_gradient_semantics(
    mesh, check_vma, sums_gradients, trains_as_the_reference
):
    """The kit picks its per-shard step by capability vma-gradients: each step trains as the
    reference under its own semantics, and the summing one is wrong without vma checks."""
    model, optimizer = M.make_mlp()
    step = ml.shard_map(
        M.train_step(per_shard=True, sums_gradients=sums_gradients),
        mesh=mesh,
        in_specs=(M.TENSOR_PARALLEL, M.TENSOR_PARALLEL, P("data"), P("data")),
        out_specs=P(),
        check_vma=check_vma,
    )
    x, y = M.batch()
    losses = [float(step(model, optimizer, x, y)) for _ in range(M.STEPS)]
    ref_losses, ref_arrays = M.reference_training()
    if not trains_as_the_reference:
        assert abs(losses[1] - ref_losses[1]) > 1e-3
        return
    np.testing.assert_allclose(losses, ref_losses, atol=M.TOLERANCE)
    for path, value in M.flat_arrays(model).items():
        np.testing.assert_allclose(value, ref_arrays[path], atol=M.TOLERANCE, err_msg=str(path))


def test_nnx_shard_maps_graph_options(data_mesh):
    forward = ml.shard_map(
        lambda m, x: m(x),
        mesh=data_mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
        graph=True,
        graph_updates=True,
    )
    assert forward(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.ones((8, 4))).shape == (8, 4)
    with pytest.raises(ValueError, match="graph=False asks for flax's tree mode"):
        ml.shard_map(lambda x: x, mesh=data_mesh, in_specs=P(), out_specs=P(), graph=False)


def test_a_batch_committed_elsewhere_is_resharded_as_jax_shard_map_does(mesh):
    """Under ml.use_mesh every eager array is committed replicated; jax.shard_map moves it
    to in_specs (jax.jit would refuse it), and so does ml.shard_map, stages included."""

    def double(a):
        return a * 2

    with ml.use_mesh(mesh):
        x = jnp.arange(16.0).reshape(8, 2)  # committed, P()
        assert x.sharding.spec == P()
        theirs = jax.jit(jax.shard_map(double, in_specs=P("data"), out_specs=P("data")))(x)
        lifted = ml.shard_map(double, in_specs=P("data"), out_specs=P("data"))
        ours = lifted(x)
        compiled = lifted.lower(x).compile()
        np.testing.assert_array_equal(compiled(x), theirs)
    np.testing.assert_array_equal(ours, theirs)
    assert ours.sharding == theirs.sharding
    assert x.sharding.spec == P()  # the caller's array is not changed
