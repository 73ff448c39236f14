"""`meshlift.partitioning` against `flax.linen.partitioning`: the same T5X-style code, both ways.

Each test runs one piece of code twice, once with `flax.linen.partitioning`
(the reference) and once with `meshlift.partitioning`, and compares: the
initialised variables, `params_axes`, `get_axis_names`, the lowered sharding
constraints and, for a scanned model, a training step under `ml.pjit` (old
pjit's call-site mesh, `with mesh:` and `ml.use_mesh`) against the same step
under flax's helpers and `jax.jit` with `NamedSharding`s.
"""

import re
import warnings

import flax.linen as nn
import flax.linen.partitioning as flax_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import freeze, unfreeze
from flax.core import spmd as flax_core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
import meshlift.partitioning as nn_partitioning

BOTH = pytest.mark.parametrize(
    "partitioning", [flax_partitioning, nn_partitioning], ids=["flax", "meshlift"]
)
AXIS_RULES_1 = (("foo", "data"), ("bar", "model"), ("baz", None))
AXIS_RULES_2 = (("foo", "model"), ("bar", None), ("baz", "data"))


@pytest.fixture(autouse=True)
def no_rules_left_behind():
    yield
    flax_core_spmd.set_logical_axis_rules(())


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def constraints(text):
    return re.findall(r"sharding_constraint %\S+ (<@\w+, \[.*?\]>)", text)


def test_every_public_name_of_flax_partitioning_is_here():
    flax_names = {
        name
        for name, obj in vars(flax_partitioning).items()
        if not name.startswith("_")
        and getattr(obj, "__module__", "").startswith(
            ("flax.linen.partitioning", "flax.linen.spmd", "flax.core.spmd")
        )
    } | {"ScanIn", "ScanOut"}
    assert flax_names <= set(nn_partitioning.__all__), flax_names - set(nn_partitioning.__all__)
    for name in nn_partitioning.__all__:
        assert hasattr(nn_partitioning, name), name
    # flax's metadata objects are flax's own, so trees mix freely
    assert nn_partitioning.AxisMetadata is flax_partitioning.AxisMetadata
    assert nn_partitioning.RulesFallback is flax_partitioning.RulesFallback


# -- the rules: one context, flax's own tests run with each module --------------------------


@BOTH
def test_axis_rules(partitioning):
    assert nn.spmd.get_logical_axis_rules() == ()
    partitioning.set_axis_rules(AXIS_RULES_1)
    assert nn.spmd.get_logical_axis_rules() == AXIS_RULES_1
    assert partitioning.get_axis_rules() == AXIS_RULES_1
    assert ml.logical_to_mesh(("foo", "bar")) == P("data", "model")  # meshlift sees them too
    partitioning.set_axis_rules(())


@BOTH
def test_axis_rules_context(partitioning):
    partitioning.set_axis_rules(AXIS_RULES_1)
    assert partitioning.get_axis_rules() == AXIS_RULES_1
    with partitioning.axis_rules(AXIS_RULES_2):
        assert partitioning.get_axis_rules() == AXIS_RULES_2
        assert flax_partitioning.get_axis_rules() == nn_partitioning.get_axis_rules()
        with ml.axis_rules(AXIS_RULES_1):
            assert partitioning.get_axis_rules() == AXIS_RULES_1
    assert partitioning.get_axis_rules() == AXIS_RULES_1


def test_logical_to_mesh_axes_and_logical_to_mesh_as_flax():
    unconstrained = P.UNCONSTRAINED
    cases = [("foo", "bar"), ("foo", unconstrained, unconstrained, None, None), ("baz", "x")]
    for rules in (AXIS_RULES_1, AXIS_RULES_2):
        for names in cases:
            expected = flax_partitioning.logical_to_mesh_axes(names, rules=rules)
            assert nn_partitioning.logical_to_mesh_axes(names, rules=rules) == expected
            with nn_partitioning.axis_rules(rules):
                assert nn_partitioning.logical_to_mesh_axes(names) == expected
        tree = {"w": P("foo", "bar"), "b": P("bar"), "n": None}
        expected = flax_partitioning.logical_to_mesh(tree, rules)
        assert nn_partitioning.logical_to_mesh(tree, rules) == expected


@pytest.mark.parametrize("fallback", list(flax_partitioning.RulesFallback), ids=lambda f: f.value)
def test_with_sharding_constraint_and_fallback_as_flax(mesh, fallback):
    def lowered(partitioning, names):
        def f(x):
            return partitioning.with_sharding_constraint(x * 2, names, fallback=fallback)

        with jax.set_mesh(mesh), partitioning.axis_rules(AXIS_RULES_1):
            return constraints(jax.jit(f).lower(jnp.ones((2, 8))).as_text())

    for names in [("foo", "bar"), ("foo", "not_recognized"), ("foo", P.UNCONSTRAINED), None]:
        try:
            expected = lowered(flax_partitioning, names)
        except ValueError:
            with pytest.raises(ValueError):
                lowered(nn_partitioning, names)
            continue
        assert lowered(nn_partitioning, names) == expected, names


# -- param_with_axes, variable_with_axes, get_axis_names: flax's tests, both ways --------------


@BOTH
@pytest.mark.parametrize("axes", [None, ()])
def test_param_with_axes_no_axes(partitioning, axes):
    class ParamTest(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = lambda k, s, d: jnp.zeros(s, d)  # noqa: E731
            return x + partitioning.param_with_axes("foo", init, (2, 2), x.dtype, axes=axes)

    ParamTest().init(jax.random.key(0), jnp.ones((2, 2)))


@BOTH
def test_param_pytree_with_axes(partitioning):
    def init_fn(k, s, d):
        return {"a": jnp.zeros(s, d), "b": (jnp.zeros(s, d), jnp.zeros(s, d))}

    axes = {"a": ("foo", "bar"), "b": (("foo", "bar"), ("bar", "foo"))}

    class ParamTest(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + partitioning.param_with_axes("foo", init_fn, (2, 2), x.dtype, axes=axes)["a"]

    with partitioning.axis_rules((("foo", "model"), ("bar", "data"), ("baz", None))):
        variables = ParamTest().init(jax.random.key(0), jnp.ones((2, 2)))
    assert variables["params_axes"]["foo_axes"] == partitioning.AxisMetadata(names=axes)
    assert partitioning.get_axis_names(variables["params_axes"]) == freeze(
        {"foo": {"a": P("foo", "bar"), "b": (P("foo", "bar"), P("bar", "foo"))}}
    )


def test_variable_with_axes_and_fallback_as_flax(mesh):
    def build(partitioning, fallback):
        class VarTest(nn.Module):
            @nn.compact
            def __call__(self, x):
                foo = partitioning.variable_with_axes(
                    "test", "foo", jnp.zeros, (2, 8), x.dtype, axes=("foo", "bar"),
                    fallback=fallback,
                )  # fmt: skip
                return x + foo.value

        return VarTest()

    rules = (("bar", "model"), ("baz", None))  # no rule for 'foo'
    x = jnp.ones((2, 8))
    results = {}
    for partitioning in (flax_partitioning, nn_partitioning):
        for fallback in partitioning.RulesFallback:
            model = build(partitioning, fallback)
            with jax.set_mesh(mesh), partitioning.axis_rules(rules):
                try:
                    variables = model.init(jax.random.key(0), x)
                except ValueError:
                    results[partitioning, fallback] = "raised"
                    continue
                text = jax.jit(model.init).lower(jax.random.key(0), x).as_text()
            assert partitioning.get_axis_names(variables["test_axes"]) == {"foo": P("foo", "bar")}
            results[partitioning, fallback] = constraints(text)
    fb = flax_partitioning.RulesFallback
    for fallback in fb:
        assert results[nn_partitioning, fallback] == results[flax_partitioning, fallback]
    assert results[nn_partitioning, fb.RAISE_ERROR] == "raised"
    assert results[nn_partitioning, fb.NO_CONSTRAINT] == []
    assert set(results[nn_partitioning, fb.AXIS_IS_UNSHARDED]) == {'<@mesh, [{}, {"model"}]>'}


def run_both(build, *args, rules):
    """`build(partitioning)` -> module; init with each partitioning module under `rules`."""
    out = []
    for partitioning in (flax_partitioning, nn_partitioning):
        with partitioning.axis_rules(rules):
            out.append(build(partitioning).init(jax.random.key(0), *args))
    return out


def test_scan_with_axes_as_flax():
    def build(partitioning):
        class SinDot(nn.Module):
            depth: int

            @nn.compact
            def __call__(self, x):
                init = nn.initializers.xavier_normal()
                w1 = partitioning.param_with_axes(
                    "W1", init, (x.shape[-1], self.depth), axes=("emb", "mlp")
                )
                w2 = partitioning.param_with_axes(
                    "W2", init, (self.depth, x.shape[-1]), axes=("mlp", "emb")
                )
                y = jnp.dot(jnp.sin(jnp.dot(x, w1)), w2)
                partitioning.variable_with_axes("stats", "y_st", lambda: y, axes=("batch", "emb"))
                return y, None

        class Scanned(nn.Module):
            @nn.compact
            def __call__(self, x):
                layer = partitioning.scan_with_axes(
                    SinDot,
                    in_axes=(),
                    variable_axes={"params": 0, "stats": 1},
                    split_rngs={"params": True},
                    axis_name="layer",
                    axes_collections=("params", "stats"),
                    length=4,
                )(32, name="scanned_layer")
                y, _ = layer(x)
                layer(x)  # metadata stays compatible across calls
                return y

        return Scanned()

    x = jnp.ones((8, 32))
    theirs, ours = run_both(build, x, rules=(("emb", "data"), ("mlp", "model"), ("batch", "data")))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, ours, theirs)))
    assert ours["params_axes"] == theirs["params_axes"]
    names = nn_partitioning.get_axis_names(ours["params_axes"])
    assert names == flax_partitioning.get_axis_names(theirs["params_axes"])
    assert names["scanned_layer"]["W1"] == P("layer", "emb", "mlp")
    stats = nn_partitioning.get_axis_names(ours["stats_axes"])
    assert stats == {"scanned_layer": {"y_st": P("batch", "layer", "emb")}}


def test_vmap_with_axes_as_flax():
    def build(partitioning):
        class Foo(nn.Module):
            @nn.compact
            def __call__(self, x):
                init = jax.nn.initializers.uniform()
                return partitioning.param_with_axes("w", init, [4, 3], axes=("out", "in")) @ x

        class Vmapped(nn.Module):
            @nn.compact
            def __call__(self, x):
                vmapped = partitioning.vmap_with_axes(
                    Foo,
                    variable_axes={"params": 1},
                    split_rngs={"params": True},
                    partitioning_axis_names={"params": "vmap_axis"},
                )
                return vmapped(name="foo_vmapped")(x)

        return Vmapped()

    x = jnp.array([[1.0, 2, 3], [4, 5, 6]])
    theirs, ours = run_both(build, x, rules=(("out", None), ("in", "data"), ("vmap_axis", "model")))
    assert ours["params_axes"] == theirs["params_axes"]
    assert nn_partitioning.get_axis_names(ours["params_axes"]) == {
        "foo_vmapped": {"w": P("out", "vmap_axis", "in")}
    }
    np.testing.assert_array_equal(
        ours["params"]["foo_vmapped"]["w"], theirs["params"]["foo_vmapped"]["w"]
    )


# -- a T5X-style model: scanned layers, trained under ml.pjit as under flax + jax.jit ----------

EMBED, MLP, LAYERS = 16, 32, 3
RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("layers", None))
TX = optax.adam(1e-2)


def t5x_model(partitioning):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            w1 = partitioning.param_with_axes("wi", init, (EMBED, MLP), axes=("embed", "mlp"))
            w2 = partitioning.param_with_axes("wo", init, (MLP, EMBED), axes=("mlp", "embed"))
            h = partitioning.with_sharding_constraint(nn.relu(x @ w1), ("batch", "mlp"))
            y = partitioning.with_sharding_constraint(x + h @ w2, ("batch", "embed"))
            return y, None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scale = partitioning.param_with_axes(
                "scale", nn.initializers.ones_init(), (EMBED,), axes=("embed",)
            )
            stack = partitioning.scan_with_axes(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(),
                length=LAYERS,
                axis_name="layers",
            )
            y, _ = stack(name="layers")(x * scale)
            return y

    return Model()


def data():
    x = jax.random.normal(jax.random.key(1), (8, EMBED))
    return x, jnp.sin(x)


def make_step(partitioning):
    model = t5x_model(partitioning)

    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, train_step


def init_and_specs(partitioning):
    """What T5X did: init, read the logical names, map them to mesh specs by the rules."""
    model, _ = make_step(partitioning)
    x, _ = data()
    with partitioning.axis_rules(RULES):
        variables = model.init(jax.random.key(0), x)
        names = partitioning.get_axis_names(variables["params_axes"])
        param_specs = unfreeze(partitioning.logical_to_mesh(names))  # shaped like the params
    params = variables["params"]
    opt_specs = (
        optax.ScaleByAdamState(count=None, mu=param_specs, nu=param_specs),
        optax.EmptyState(),
    )
    return variables, params, param_specs, opt_specs


def test_t5x_model_init_axes_as_flax():
    theirs, _, their_specs, _ = init_and_specs(flax_partitioning)
    ours, _, our_specs, _ = init_and_specs(nn_partitioning)
    assert ours["params_axes"] == theirs["params_axes"]
    assert nn_partitioning.get_axis_names(ours["params_axes"]) == flax_partitioning.get_axis_names(
        theirs["params_axes"]
    )
    assert our_specs == their_specs
    assert our_specs["layers"]["wi"] == P(None, None, "model")
    assert our_specs["scale"] == P(None)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, ours["params"], theirs["params"])))


def reference_run(mesh, steps=3):
    """flax's helpers, plain `jax.jit` with `NamedSharding`s: what old pjit did, written out."""
    _, params, param_specs, opt_specs = init_and_specs(flax_partitioning)
    _, train_step = make_step(flax_partitioning)

    def named(specs):
        return jax.tree.map(
            lambda s: NamedSharding(mesh, P() if s is None else s),
            specs,
            is_leaf=lambda s: s is None or isinstance(s, P),
        )

    step = jax.jit(
        train_step,
        in_shardings=named((param_specs, opt_specs, P("data"), P("data"))),
        out_shardings=named((param_specs, opt_specs, None)),
    )
    x, y = data()
    opt_state = TX.init(params)
    losses = []
    with jax.set_mesh(mesh), flax_partitioning.axis_rules(RULES):
        text = step.lower(params, opt_state, x, y).as_text()
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(float(loss))
    return params, losses, text


@pytest.mark.parametrize("context", ["with mesh", "ml.use_mesh"])
def test_t5x_train_step_under_ml_pjit_gives_flax_numbers(mesh, context):
    ref_params, ref_losses, ref_text = reference_run(mesh)

    _, params, param_specs, opt_specs = init_and_specs(nn_partitioning)
    _, train_step = make_step(nn_partitioning)
    step = ml.pjit(
        train_step,
        in_axis_resources=(param_specs, opt_specs, P("data"), P("data")),
        out_axis_resources=(param_specs, opt_specs, None),
    )
    x, y = data()
    opt_state = TX.init(params)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` is deprecated in JAX
        mesh_context = mesh if context == "with mesh" else ml.use_mesh(mesh)
        with mesh_context, nn_partitioning.axis_rules(RULES):
            text = step.lower(params, opt_state, x, y).as_text()
            for _ in range(3):
                params, opt_state, loss = step(params, opt_state, x, y)
                losses.append(float(loss))

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        assert ours.sharding == theirs.sharding
    assert params["layers"]["wi"].sharding.spec == P(None, None, "model")
    # the same constraints reach the compiler: the params' (param_with_axes) and activations'
    assert sorted(constraints(text)) == sorted(constraints(ref_text))
    assert '<@mesh, [{"data"}, {"model"}]>' in constraints(text)
