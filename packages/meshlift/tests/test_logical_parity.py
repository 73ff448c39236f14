"""Logical axes and metadata against flax: the same code run both ways gives the same answers.

The reference for each test is flax 0.12's own function on the same input:
`flax.linen.spmd` (`logical_to_mesh_axes`, `with_logical_constraint`,
`RulesFallback`), `flax.core.spmd`'s rules context, `nn.get_partition_spec` +
`nn.logical_to_mesh_sharding` (linen) and `nnx.get_partition_spec` (NNX),
`nn.with_partitioning` under flax.core's `Scope` API and `nnx.with_partitioning`
under `nnx.bridge.to_linen`.
"""

import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import core, nnx
from flax.core import spmd as flax_core_spmd
from flax.linen import spmd as flax_spmd
from flax.nnx import bridge
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.plans.logical import get_axis_rules, set_axis_rules

U = P.UNCONSTRAINED
Fallback = flax_spmd.RulesFallback

# From flax 0.12.11 on, `bridge.to_linen` keeps only the required metadata on its `NNXMeta`
# boxes (no `eager_sharding=False`), so linen's `nn.get_partition_spec` re-creates each
# Variable eagerly sharded and raises (outside a mesh and under one), for flax's own
# `nnx.with_partitioning` as for meshlift's; `ml.get_partition_spec` still reads them.
LINEN_READS_BRIDGED_SPECS = tuple(map(int, flax.__version__.split(".")[:3])) < (0, 12, 11)


@pytest.fixture(autouse=True)
def no_rules_left_behind():
    yield
    flax_core_spmd.set_logical_axis_rules(())


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def constraints(text):
    """The sharding of every `sharding_constraint` in lowered StableHLO, in order."""
    return re.findall(r"sharding_constraint %\S+ (<@\w+, \[.*?\]>)", text)


# -- one rules context --------------------------------------------------------------------


def test_one_rules_context_shared_with_flax():
    rules = (("batch", "data"), ("mlp", "model"))
    with ml.axis_rules(rules):
        assert flax_core_spmd.get_logical_axis_rules() == rules
        assert flax_spmd.logical_to_mesh_axes(("batch", "mlp")) == P("data", "model")
        with nn.logical_axis_rules((("batch", "model"),)):  # flax's context, read by meshlift
            assert ml.logical_to_mesh(("batch", "mlp")) == P("model", None)
            assert get_axis_rules() == (("batch", "model"),)
        assert ml.logical_to_mesh(("batch", "mlp")) == P("data", "model")
    assert get_axis_rules() == () == flax_core_spmd.get_logical_axis_rules()
    set_axis_rules(rules)
    assert flax_core_spmd.get_logical_axis_rules() == rules
    assert ml.logical_to_mesh(("batch", None)) == P("data", None)


def test_rules_are_kept_as_given_like_flax():
    rules = [["batch", ["data", "model"]]]
    with ml.axis_rules(rules) as checked:
        assert get_axis_rules() is rules  # flax's get_axis_rules returns what was set
        assert checked == (("batch", ("data", "model")),)
        assert ml.logical_to_mesh(("batch",)) == P(("data", "model"))
        assert ml.logical_to_mesh(("batch",)) == flax_spmd.logical_to_mesh_axes(("batch",))


@pytest.mark.parametrize(
    "setter",
    [
        lambda rules: ml.axis_rules(rules).__enter__(),
        set_axis_rules,
        lambda rules: ml.logical_to_mesh(("batch",), rules),
        lambda rules: ml.logical_to_mesh_sharding(P("batch"), ml.make_mesh({"x": 8}), rules),
    ],
    ids=["axis_rules", "set_axis_rules", "logical_to_mesh", "logical_to_mesh_sharding"],
)
def test_a_rule_repeating_a_mesh_axis_is_refused_when_given(setter):
    with pytest.raises(ValueError, match=r"uses the mesh axis 'x' twice.*write \('batch', 'x'\)"):
        setter([("batch", ("x", "x"))])
    assert get_axis_rules() == ()  # nothing was set


def test_a_repeating_rule_set_through_flax_is_refused_when_meshlift_reads_it():
    with nn.logical_axis_rules((("batch", ("x", "x")),)):  # flax accepts it ...
        assert flax_spmd.logical_to_mesh_axes(("batch",)) == P(("x", "x"))
        with pytest.raises(ValueError, match="twice"):  # ... meshlift never builds that spec
            ml.logical_to_mesh(("batch",))


# -- resolution: flax's own cases, run both ways -------------------------------------------

CASES = [  # flax's tests/linen/partitioning_test.py, test_logical_to_mesh_axes_cases
    ((("a", ("model", "data")), ("b", "data")), ("a", "b")),
    ((("a", ("model", "replica")), ("b", "data")), ("a", "b")),
    ((("a", ("model", "replica")), ("b", ("data", "model"))), ("a", "b")),
    ((("a", ("model", "replica")), ("b", "model")), ("a", "b", "c")),
    ((), ("a", "b", "c")),
    ((("a", None), ("a", "model")), ("a", "b")),
    ((("baz", "data"), ("bar", None), ("foo", "model"), ("foo", "data")), ("baz", "bar", "foo")),
    ((("baz", "data"), ("foo", ("model", "emb"))), ("baz", U, "foo")),
    ((("foo", "data"), ("bar", "model"), ("baz", None)), ("foo", U, U, None, None)),
    ((("foo", "model"), ("bar", "model"), ("baz", "data")), ("bar", "foo", "baz", "unassigned")),
    # a rule giving UNCONSTRAINED, and one after it for the same name (never reached)
    ((("seq", U), ("seq", "model"), ("batch", "data")), ("batch", "seq")),
    ((("seq", U), ("batch", "model")), ("seq", "batch", None)),
]


@pytest.mark.parametrize(("rules", "names"), CASES)
def test_logical_to_mesh_axes_as_flax(rules, names):
    expected = flax_spmd.logical_to_mesh_axes(names, rules)
    assert ml.logical_to_mesh_axes(names, rules) == expected
    assert ml.logical_to_mesh(P(*names), rules) == expected
    with ml.axis_rules(rules):
        assert ml.logical_to_mesh_axes(names) == flax_spmd.logical_to_mesh_axes(names)


def test_duplicate_names_are_refused_as_in_flax():
    rules = (("foo", "data"),)
    with pytest.raises(ValueError):
        flax_spmd.logical_to_mesh_axes(("foo", "foo", "baz"), rules)
    with pytest.raises(ValueError, match="names two dimensions"):
        ml.logical_to_mesh_axes(("foo", "foo", "baz"), rules)


# -- with_logical_constraint: UNCONSTRAINED and fallback, against flax's ------------------

RULES = (("foo", "data"), ("bar", "model"), ("baz", None))


def lowered_constraints(fn, mesh, rules=RULES):
    with jax.set_mesh(mesh), ml.axis_rules(rules):
        return constraints(jax.jit(fn).lower(jnp.ones((8, 8))).as_text())


@pytest.mark.parametrize(
    "names",
    [("foo", "bar"), ("foo", U), (U, "bar"), ("foo", "nope"), ("baz", "foo"), None, (None, None)],
)
@pytest.mark.parametrize("fallback", list(Fallback), ids=lambda f: f.value)
def test_with_logical_constraint_as_flax(mesh, names, fallback):
    def ours(x):
        return ml.with_logical_constraint(x * 2, names, fallback=fallback)

    def theirs(x):
        return flax_spmd.with_logical_constraint(x * 2, names, fallback=fallback)

    try:
        expected = lowered_constraints(theirs, mesh)
    except ValueError:
        with pytest.raises(ValueError, match="did not match a rule"):
            lowered_constraints(ours, mesh)
        return
    assert lowered_constraints(ours, mesh) == expected
    with jax.set_mesh(mesh), ml.axis_rules(RULES):
        out, ref = jax.jit(ours)(jnp.ones((8, 8))), jax.jit(theirs)(jnp.ones((8, 8)))
    assert out.sharding == ref.sharding


def test_unconstrained_names_and_rules_lower_as_in_flax(mesh):
    rules = (("batch", "data"), ("seq", U))
    for names in [("batch", U), ("batch", "seq"), (U, U)]:
        ours = lowered_constraints(lambda x, n=names: ml.with_logical_constraint(x, n), mesh, rules)
        theirs = lowered_constraints(
            lambda x, n=names: flax_spmd.with_logical_constraint(x, n), mesh, rules
        )
        assert ours == theirs and len(ours) == 1, names
    # a whole pytree, with the mesh given explicitly
    tree = {"a": jnp.ones((8, 8)), "b": jnp.ones((8, 4))}
    names = {"a": ("batch", U), "b": (U, "seq")}
    with ml.axis_rules(rules):
        ours = jax.jit(lambda t: ml.with_logical_constraint(t, names, mesh=mesh)).lower(tree)
        theirs = jax.jit(lambda t: flax_spmd.with_logical_constraint(t, names, mesh=mesh)).lower(
            tree
        )
    assert constraints(ours.as_text()) == constraints(theirs.as_text())


def test_raise_error_fallback_raises_without_a_mesh_too_as_flax():
    x = jnp.ones((8, 8))
    with ml.axis_rules(RULES):
        with pytest.raises(ValueError):
            flax_spmd.with_logical_constraint(x, ("foo", "nope"), fallback=Fallback.RAISE_ERROR)
        with pytest.raises(ValueError, match=r"no rule gives mesh axes to 'nope'"):
            ml.with_logical_constraint(x, ("foo", "nope"), fallback=Fallback.RAISE_ERROR)
        # the values of the enum are accepted too, and nothing else
        assert ml.with_logical_constraint(x, ("foo", "nope"), fallback="no_constraint") is x
        with pytest.raises(ValueError, match="RulesFallback"):
            ml.with_logical_constraint(x, ("foo",), fallback="ignore")


# -- get_partition_spec then logical_to_mesh_sharding: flax's recipe ------------------------


class LogicalMLP(nn.Module):
    with_logical_partitioning: object

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(
            32, kernel_init=self.with_logical_partitioning(init, ("a", "b")), name="hidden"
        )(x)
        w = self.param("w", self.with_logical_partitioning(init, ("b", "a")), (32, x.shape[-1]))
        return nn.relu(h) @ w


def recipe_mesh():
    return ml.make_mesh({"in": 2, "out": 4})


RECIPE_RULES = (("a", "in"), ("b", "out"))


def flax_recipe(abstract, mesh, rules):
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)


def assert_same_shardings(ours, flax_ones, mesh):
    """Equal where flax gives a sharding; where flax gives None (an unannotated array),
    meshlift gives the replicated sharding (its `P()`)."""
    flat_flax = jax.tree_util.tree_flatten_with_path(
        flax_ones, is_leaf=lambda x: x is None or isinstance(x, NamedSharding)
    )[0]
    flat_ours = dict(jax.tree_util.tree_flatten_with_path(ours)[0])
    assert len(flat_ours) == len(flat_flax)
    for path, sharding in flat_flax:
        expected = NamedSharding(mesh, P()) if sharding is None else sharding
        assert flat_ours[path] == expected, jax.tree_util.keystr(path)


@pytest.mark.parametrize("in_context", [True, False], ids=["inside-rules", "outside-rules"])
def test_linen_get_partition_spec_then_logical_to_mesh_sharding_as_flax(in_context):
    mesh, x = recipe_mesh(), jnp.ones((8, 16))
    ours_model = LogicalMLP(ml.with_logical_partitioning)
    flax_model = LogicalMLP(nn.with_logical_partitioning)
    ours_abstract = jax.eval_shape(ours_model.init, jax.random.key(0), x)
    flax_abstract = jax.eval_shape(flax_model.init, jax.random.key(0), x)
    if in_context:
        with ml.axis_rules(RECIPE_RULES):
            specs = ml.get_partition_spec(ours_abstract)
            shardings = ml.logical_to_mesh_sharding(specs, mesh, RECIPE_RULES)
        with nn.logical_axis_rules(RECIPE_RULES):
            expected = flax_recipe(flax_abstract, mesh, RECIPE_RULES)
    else:
        specs = ml.get_partition_spec(ours_abstract)
        shardings = ml.logical_to_mesh_sharding(specs, mesh, RECIPE_RULES)
        expected = flax_recipe(flax_abstract, mesh, RECIPE_RULES)
    assert specs["params"]["hidden"]["kernel"] == P("a", "b")  # logical, as flax's
    assert shardings["params"]["hidden"]["kernel"] == NamedSharding(mesh, P("in", "out"))
    assert_same_shardings(shardings, expected, mesh)
    # flax's recipe on meshlift's boxes gives the same, and ml.get_sharding agrees
    assert_same_shardings(shardings, flax_recipe(ours_abstract, mesh, RECIPE_RULES), mesh)
    assert ml.get_sharding(ours_abstract, mesh, RECIPE_RULES) == shardings
    # rules passed to get_partition_spec itself map the names there
    mapped = ml.get_partition_spec(ours_abstract, RECIPE_RULES)
    assert mapped["params"]["w"] == P("out", "in")


class NNXMLP(nnx.Module):
    def __init__(self, annotate, rngs):
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(16, 32, kernel_init=annotate(init, ("a", "b")), rngs=rngs)
        self.w = nnx.Param(annotate(init, ("b", "a"))(rngs.params(), (32, 16)))


def test_nnx_get_partition_spec_then_logical_to_mesh_sharding_as_flax():
    mesh = recipe_mesh()
    ours = nnx.eval_shape(lambda: NNXMLP(ml.with_logical_partitioning, nnx.Rngs(0)))
    theirs = nnx.eval_shape(
        lambda: NNXMLP(
            lambda f, names: nnx.with_partitioning(f, names, eager_sharding=False), nnx.Rngs(0)
        )
    )
    # outside the rules (MaxText's NNX recipe): logical specs, mapped once
    ours_specs = ml.get_partition_spec(ours)
    theirs_specs = nnx.get_partition_spec(nnx.state(theirs))
    assert ours_specs == theirs_specs
    ours_shardings = ml.logical_to_mesh_sharding(ours_specs, mesh, RECIPE_RULES)
    theirs_shardings = nn.logical_to_mesh_sharding(theirs_specs, mesh, RECIPE_RULES)
    assert ours_shardings == theirs_shardings
    assert ours_shardings["w"].get_value() == NamedSharding(mesh, P("out", "in"))
    # inside rules that name every logical axis, both map at once, as nnx.get_partition_spec
    with ml.axis_rules(RECIPE_RULES):
        assert ml.get_partition_spec(ours) == nnx.get_partition_spec(nnx.state(theirs))


# -- with_partitioning: flax.core's Scope API, and NNX inside linen (bridge.to_linen) -------


def scope_model(with_partitioning, with_logical_partitioning):
    init = nn.initializers.lecun_normal()

    def fn(scope, x):
        w = scope.param("w", with_partitioning(init, (None, "model")), (x.shape[-1], 8))
        v = scope.param("v", with_logical_partitioning(init, ("mlp", "embed")), (8, 4))
        count = scope.variable("stats", "count", with_partitioning(jnp.zeros, ("model",)), (8,))
        count.value += 1
        return (x @ w) @ v

    return fn


def test_with_partitioning_under_flax_core_scope_api_as_flax(mesh):
    x = jnp.ones((8, 16))
    ours = scope_model(ml.with_partitioning, ml.with_logical_partitioning)
    theirs = scope_model(nn.with_partitioning, nn.with_logical_partitioning)
    ours_y, ours_vars = core.init(ours, mutable=True)(jax.random.key(0), x)
    theirs_y, theirs_vars = core.init(theirs, mutable=True)(jax.random.key(0), x)
    assert isinstance(ours_vars["params"]["w"], nn.Partitioned)
    assert isinstance(ours_vars["params"]["v"], nn.LogicallyPartitioned)
    box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    kinds = lambda t: jax.tree.map(lambda b: (type(b), b.names, b.mesh), t, is_leaf=box)  # noqa: E731
    assert kinds(ours_vars) == kinds(theirs_vars)
    assert jax.tree.all(jax.tree.map(np.array_equal, nn.unbox(ours_vars), nn.unbox(theirs_vars)))
    np.testing.assert_array_equal(ours_y, theirs_y)
    assert nn.get_partition_spec(ours_vars) == nn.get_partition_spec(theirs_vars)

    # apply with the boxed variables under a mesh (jitted, as flax's boxes need): the
    # boxes constrain as flax's do
    def applied(fn):
        return jax.jit(lambda v: core.apply(fn, mutable=["stats"])(v, x)[0])

    with jax.set_mesh(mesh), ml.axis_rules((("mlp", "model"),)):
        out, ref = applied(ours)(ours_vars), applied(theirs)(theirs_vars)
        ours_text = applied(ours).lower(ours_vars).as_text()
        theirs_text = applied(theirs).lower(theirs_vars).as_text()
    np.testing.assert_array_equal(out, ref)
    assert constraints(ours_text) == constraints(theirs_text)
    assert constraints(ours_text) == ['<@mesh, [{}, {"model"}]>', '<@mesh, [{"model"}, {}]>']


class Bridged(nnx.Module):
    def __init__(self, din, dout, annotate, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.linear = nnx.Linear(din, dout, kernel_init=annotate(init, (None, "model")), rngs=rngs)
        self.scale = nnx.Param(annotate(nnx.initializers.ones_init(), ("model",))(None, (dout,)))

    def __call__(self, x):
        return self.linear(x) * self.scale[...]


def nnx_annotate(eager):
    def annotate(init, names):
        return nnx.with_partitioning(init, names, eager_sharding=eager)

    return annotate


def test_with_partitioning_inside_bridge_to_linen_gives_nnx_metadata_as_nnx():
    x = jnp.ones((8, 16))
    ours = bridge.to_linen(Bridged, 16, 32, ml.with_partitioning)
    theirs = bridge.to_linen(Bridged, 16, 32, nnx_annotate(False))
    ours_vars = ours.init(jax.random.key(0), x)
    theirs_vars = theirs.init(jax.random.key(0), x)
    is_meta = lambda v: isinstance(v, nn.meta.AxisMetadata)  # noqa: E731
    kinds = jax.tree.map(lambda b: type(b).__name__, ours_vars, is_leaf=is_meta)
    assert kinds == jax.tree.map(lambda b: type(b).__name__, theirs_vars, is_leaf=is_meta)
    if LINEN_READS_BRIDGED_SPECS:  # see above: flax >= 0.12.11 raises here for both
        assert nn.get_partition_spec(ours_vars) == nn.get_partition_spec(theirs_vars)
        assert nn.get_partition_spec(ours_vars)["params"]["linear"]["kernel"] == P(None, "model")
    assert ml.get_partition_spec(ours_vars)["params"]["scale"] == P("model")
    np.testing.assert_array_equal(ours.apply(ours_vars, x), theirs.apply(theirs_vars, x))


def test_with_partitioning_inside_to_linen_under_a_mesh_places_as_nnx(mesh):
    x = jnp.ones((8, 16))
    with jax.set_mesh(mesh):
        ours = jax.jit(bridge.to_linen(Bridged, 16, 32, ml.with_partitioning).init)(
            jax.random.key(0), x
        )
        theirs = jax.jit(bridge.to_linen(Bridged, 16, 32, nnx_annotate(True)).init)(
            jax.random.key(0), x
        )
    spec = lambda v: v.sharding.spec  # noqa: E731
    assert jax.tree.map(spec, nn.unbox(ours)) == jax.tree.map(spec, nn.unbox(theirs))
    assert nn.unbox(ours)["params"]["linear"]["kernel"].sharding.spec == P(None, "model")


def test_a_linen_module_inside_nnx_gets_boxes_as_with_flax_own(mesh):
    x = jnp.ones((8, 16))

    class Outer(nnx.Module):  # NNX outside, linen (made in NNX's __init__) inside: boxes
        def __init__(self, with_partitioning, rngs):
            init = with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            self.dense = bridge.lazy_init(
                bridge.ToNNX(nn.Dense(32, kernel_init=init), rngs=rngs), x
            )

        def __call__(self, x):
            return self.dense(x)

    def wrapped(with_partitioning):
        with jax.set_mesh(mesh):  # ToNNX shards its Variables eagerly: it needs a mesh
            return Outer(with_partitioning, nnx.Rngs(0))

    ours, theirs = wrapped(ml.with_partitioning), wrapped(nn.with_partitioning)
    assert isinstance(ours.dense.kernel, nnx.Param)
    ours, theirs = ours.dense, theirs.dense
    assert ours.kernel.get_metadata()["out_sharding"] == (None, "model")
    assert ours.kernel[...].sharding.spec == theirs.kernel[...].sharding.spec == P(None, "model")
    assert ml.get_partition_spec(ours) == nnx.get_partition_spec(nnx.state(theirs))
    np.testing.assert_array_equal(ours(x), theirs(x))


def test_flax_logical_with_mesh_and_rules_case():
    """flax's `test_logical_with_mesh_and_rules`, run with each library's functions."""
    recipe = recipe_mesh()

    def create_state(with_logical_partitioning, get_partition_spec, logical_to_mesh_sharding):
        class Foo(nn.Module):
            @nn.compact
            def __call__(self, x):
                kernel_init = with_logical_partitioning(
                    nn.initializers.ones_init(), ("a", "b"), mesh=recipe, rules=RECIPE_RULES
                )
                return x @ self.param("kernel", kernel_init, (x.shape[-1], 8))

        shardings = []

        @jax.jit
        def create():
            variables = Foo().init(jax.random.key(0), jnp.zeros((8, 4)))
            shardings.append(
                logical_to_mesh_sharding(get_partition_spec(variables), recipe, RECIPE_RULES)
            )
            return jax.lax.with_sharding_constraint(variables, shardings[0])

        return create(), shardings[0]

    ours, ours_shardings = create_state(
        ml.with_logical_partitioning, ml.get_partition_spec, ml.logical_to_mesh_sharding
    )
    theirs, theirs_shardings = create_state(
        nn.with_logical_partitioning, nn.get_partition_spec, nn.logical_to_mesh_sharding
    )
    assert ours_shardings == theirs_shardings
    assert ours_shardings["params"]["kernel"] == NamedSharding(recipe, P("in", "out"))
    kernel = ours["params"]["kernel"]
    assert (kernel.names, kernel.mesh, kernel.rules) == (("a", "b"), recipe, RECIPE_RULES)
    assert kernel.value.sharding == theirs["params"]["kernel"].value.sharding
