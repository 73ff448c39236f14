"""Sharding names mean what flax means: flax's own guide and tests, renamed, give flax's shardings.

flax's "Scale up on multiple devices" guide (`docs_nnx/guides/flax_gspmd.md`)
and `tests/nnx/spmd_test.py` run twice, once as flax wrote them and once with
`nnx.with_partitioning` → `ml.with_partitioning`, `nnx.logical_axis_rules` →
`ml.axis_rules`, `jax.set_mesh` → `ml.use_mesh` and `jax.jit` → `ml.jit`; every
parameter must come out on flax's sharding. Then a typo in a rule: never silent.

flax's own code here (the guide's `nnx.vmap` over layers, `nnx.get_abstract_model`,
the `nnx.jit` reference) is graph-mode code, so it runs under `compat.graph_mode()`
also when the suite runs with flax's tree mode switched on; meshlift's calls do not.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.compat import graph_mode
from meshlift.testing import oracle
from meshlift.testing.models import graph_mode_jit

FLAX = {"with_partitioning": nnx.with_partitioning, "rules": nnx.logical_axis_rules}
MESHLIFT = {"with_partitioning": ml.with_partitioning, "rules": ml.axis_rules}
GUIDE_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))


def auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def guide_model(names, with_partitioning, depth=16, num_layers=2):
    """The guide's `MultiDotReluDot` (names `(None, 'model')`, `('model', None)`) or
    `LogicalMultiDotReluDot` (`('embed', 'hidden')`, `('hidden', 'embed')`), made in
    flax's graph mode, as the guide makes it."""
    first, second = names

    class DotReluDot(nnx.Module):
        def __init__(self, rngs):
            init_fn = nnx.initializers.lecun_normal()
            self.dot1 = nnx.Linear(
                depth,
                depth,
                kernel_init=with_partitioning(init_fn, first),
                use_bias=False,
                rngs=rngs,
            )
            self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=second)

        def __call__(self, x):
            y = jax.nn.relu(self.dot1(x))
            y = jax.lax.with_sharding_constraint(y, P("data", None))
            return jnp.dot(y, self.w2[...])

    class MultiDotReluDot(nnx.Module):
        def __init__(self, rngs):
            @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
            def create_sublayers(r):
                return DotReluDot(r)

            self.layers = create_sublayers(rngs.fork(split=num_layers))

        def __call__(self, x):
            def scan_over_layers(x, layer):
                return layer(x), None

            x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
            return x

    with graph_mode():
        return MultiDotReluDot(nnx.Rngs(0))


def specs_of(model):
    """Each array's spec, as JAX placed it (normalised: trailing Nones dropped)."""
    return {
        path: _normalised(v.get_value().sharding.spec, v.get_value().ndim)
        for path, v in nnx.to_flat_state(nnx.state(model))
    }


def _normalised(spec, ndim):
    entries = list(spec) + [None] * (ndim - len(spec))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


# the guide's own code: `rngs.fork(split=n)`, deprecated in later flax
guide_code = pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork':DeprecationWarning")

GUIDE_CASES = {
    "mesh axes": ((((None, "model"), ("model", None))), ()),
    "logical names": ((("embed", "hidden"), ("hidden", "embed")), GUIDE_RULES),
}


@guide_code
@pytest.mark.parametrize("case", GUIDE_CASES, ids=list(GUIDE_CASES))
def test_the_guide_builds_flax_shardings(case):
    names, rules = GUIDE_CASES[case]
    mesh = auto_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        reference = guide_model(names, nnx.with_partitioning)
        flax_specs = nnx.get_partition_spec(nnx.state(reference))
    with ml.use_mesh(mesh), ml.axis_rules(rules):
        model = guide_model(names, ml.with_partitioning)
        our_specs = ml.get_partition_spec(model)
        plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    assert specs_of(model) == specs_of(reference)
    assert our_specs == flax_specs
    assert specs_of(model)[("layers", "dot1", "kernel")] == P(None, None, "model")
    # an explicit rules= is never ignored: outside any rules context, the same plan
    assert ml.StateSharding.from_metadata(model, rules, mesh=mesh).rules == plan.rules


@guide_code
@pytest.mark.parametrize("case", GUIDE_CASES, ids=list(GUIDE_CASES))
def test_the_guide_trains_as_flax_does_on_the_plan_read_from_the_model(case):
    names, rules = GUIDE_CASES[case]
    mesh = auto_mesh((2, 4), ("data", "model"))

    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 16))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        reference = guide_model(names, nnx.with_partitioning)
        reference_optimizer = nnx.Optimizer(reference, optax.adam(1e-3), wrt=nnx.Param)
        flax_step = graph_mode_jit(train_step)
        flax_losses = [float(flax_step(reference, reference_optimizer, x, y)) for _ in range(3)]
    with ml.use_mesh(mesh), ml.axis_rules(rules):
        model = guide_model(names, ml.with_partitioning)
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        plan = ml.StateSharding.from_metadata(model, mesh=mesh)
        step = ml.jit(train_step, in_shardings=(plan, plan, P("data"), P("data")))
        losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    assert losses == pytest.approx(flax_losses, rel=1e-6)
    assert specs_of(model) == specs_of(reference)
    assert specs_of(optimizer) == specs_of(reference_optimizer)


# -- flax's tests/nnx/spmd_test.py, renamed ------------------------------------------------


@pytest.mark.parametrize("api", [FLAX, MESHLIFT], ids=["flax", "meshlift"])
def test_spmd_logical_rules_own_and_in_context(api):
    """spmd_test's `test_logical_rules`: a Variable's own `sharding_rules` and the context's."""

    class Foo(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(
                api["with_partitioning"](
                    lambda: jnp.ones((8, 2)),
                    sharding=("row-alias", "col-alias"),
                    sharding_rules=(("row-alias", "row"),),
                )()
            )
            self.b = nnx.Param(
                api["with_partitioning"](lambda: jnp.zeros((2,)), sharding=("col-alias",))()
            )

    mesh = auto_mesh((1, 2, 2), ("layers", "row", "col"))
    with jax.set_mesh(mesh), api["rules"]((("col-alias", "col"),)):
        model = Foo()
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    expected = NamedSharding(mesh, P("row", "col"))
    assert model.w.sharding.is_equivalent_to(expected, ndim=2)
    assert optimizer.opt_state[0].mu["w"].sharding.is_equivalent_to(expected, ndim=2)
    assert model.b.sharding.is_equivalent_to(NamedSharding(mesh, P("col")), ndim=1)
    assert plan.spec_for(("w",), model.w) == P("row", "col")
    assert plan.spec_for(("opt_state", 0, "nu", "w"), optimizer.opt_state[0].nu["w"]) == P(
        "row", "col"
    )


@pytest.mark.parametrize("api", [FLAX, MESHLIFT], ids=["flax", "meshlift"])
def test_spmd_init_inside_jit_and_optimizer_state(api):
    """spmd_test's `test_init` and `test_shard_optimizer_state`: mesh axes as names."""

    class Foo(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(
                api["with_partitioning"](lambda: jnp.ones((8, 2)), sharding=("row", "col"))()
            )

    mesh = auto_mesh((2, 2), ("row", "col"))
    with jax.set_mesh(mesh):
        model = nnx.merge(*jax.jit(lambda: nnx.split(Foo()))())
        graphdef, params = nnx.split(Foo())
        state = nnx.TrainState.create(graphdef, params=params, tx=optax.adam(1e-3))
    assert model.w.sharding.shard_shape(model.w.shape) == (4, 1)
    expected = NamedSharding(mesh, P("row", "col"))
    assert state.params["w"].sharding.is_equivalent_to(expected, ndim=2)
    assert state.opt_state[0].nu["w"].sharding.is_equivalent_to(expected, ndim=2)


@pytest.mark.parametrize("api", [FLAX, MESHLIFT], ids=["flax", "meshlift"])
def test_spmd_get_abstract_model(api):
    """spmd_test's `test_get_abstract_model`: a shared kernel, abstract, on its sharding."""

    class Foo(nnx.Module):
        def __init__(self, rngs):
            init = api["with_partitioning"](nnx.initializers.lecun_normal(), (None, "model"))
            self.linear = nnx.Linear(8, 8, rngs=rngs, use_bias=False, kernel_init=init)
            self.shared = self.linear.kernel

    mesh = auto_mesh((2, 2), ("batch", "model"))
    with graph_mode():  # the shared kernel needs it
        _, abstract = nnx.get_abstract_model(lambda: Foo(nnx.Rngs(0)), mesh)
    (leaf,) = jax.tree.leaves(abstract)
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), ndim=2)


def test_spmd_layers_axis_added_by_vmap_and_read_by_the_plan():
    """spmd_test's `test_add_remove_axis_in_transform`: `nnx.vmap` adds 'layers' to the names."""

    with graph_mode():  # spmd_test's nnx.vmap over __init__ takes its mode when applied

        class MLP(nnx.Module):
            @nnx.split_rngs(splits=5)
            @nnx.vmap(in_axes=(0, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
            def __init__(self, rngs):
                init = ml.with_partitioning(nnx.initializers.lecun_normal(), ("din", "dout"))
                self.linear = nnx.Linear(4, 4, kernel_init=init, rngs=rngs)

        mesh = auto_mesh((1, 2, 2), ("layers", "din", "dout"))
        with ml.use_mesh(mesh):
            model = MLP(rngs=nnx.Rngs(0))
    assert model.linear.kernel.out_sharding == ("layers", "din", "dout")
    plan = ml.StateSharding.from_metadata(model, mesh=mesh)
    assert plan.spec_for(("linear", "kernel"), model.linear.kernel) == P("layers", "din", "dout")


# -- the two meanings, side by side --------------------------------------------------------


def test_with_partitioning_names_are_mesh_axes_unless_a_rule_names_them():
    init = nnx.initializers.lecun_normal()
    layer = nnx.Linear(
        16, 32, kernel_init=ml.with_partitioning(init, ("data", "hidden")), rngs=nnx.Rngs(0)
    )
    with nnx.logical_axis_rules([("hidden", "model")]):
        assert nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == P("data", "model")
        assert ml.get_partition_spec(layer)["kernel"].get_value() == P("data", "model")
    plan = ml.StateSharding.from_metadata(
        layer, [("hidden", "model")], mesh={"data": 2, "model": 4}
    )
    assert plan.spec_for(("kernel",), layer.kernel) == P("data", "model")


def test_with_logical_partitioning_names_are_all_logical_as_in_linen():
    init = nnx.initializers.lecun_normal()
    layer = nnx.Linear(
        16, 32, kernel_init=ml.with_logical_partitioning(init, ("data", "hidden")), rngs=nnx.Rngs(0)
    )
    plan = ml.StateSharding.from_metadata(layer, [("hidden", "model")])
    assert plan.spec_for(("kernel",), layer.kernel) == P(None, "model")  # no rule: replicated
    with pytest.raises(ml.PlanError, match=r"`kernel` \(shape \(16, 32\)\) has the logical names"):
        ml.StateSharding.from_metadata(layer)


def test_a_name_whose_rules_cannot_apply_is_replicated_never_a_mesh_axis_twice():
    init = nnx.initializers.lecun_normal()
    layer = nnx.Linear(
        16, 32, kernel_init=ml.with_partitioning(init, ("embed", "hidden")), rngs=nnx.Rngs(0)
    )
    rules = [("embed", "model"), ("hidden", "model")]  # flax's resolver: P('model', 'model')
    plan = ml.StateSharding.from_metadata(layer, rules, mesh={"data": 2, "model": 4})
    assert plan.spec_for(("kernel",), layer.kernel) == P("model", None)


# -- a typo in a rule is never silent --------------------------------------------------------

TYPO_RULES = [("embed", None), ("hidden", "modle"), ("hidden", "data")]
TYPO_MESSAGE = (
    r"axis rule \('hidden', 'modle'\) names the mesh axis 'modle' \(did you mean 'model'\?\), "
    r"which the mesh \{'data': 2, 'model': 4\} lacks, so the rule is skipped for "
)


def typo_model():
    init = nnx.initializers.lecun_normal()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(
                16, 32, kernel_init=ml.with_partitioning(init, ("embed", "hidden")), rngs=rngs
            )
            self.down = nnx.Linear(
                32, 16, kernel_init=ml.with_partitioning(init, ("hidden", "embed")), rngs=rngs
            )

    return Net(nnx.Rngs(0))


def test_a_typo_warns_naming_the_rule_the_axis_the_mesh_and_the_parameters():
    model = typo_model()
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with pytest.warns(ml.AxisRuleWarning, match=TYPO_MESSAGE + r"`down.kernel`, `up.kernel`"):
        plan = ml.StateSharding.from_metadata(model, TYPO_RULES, mesh=mesh)
    # the warning says what happened: the fallback rule gave 'data', not 'model'
    assert plan.spec_for(("up", "kernel"), model.up.kernel) == P(None, "data")
    with pytest.warns(ml.AxisRuleWarning, match=TYPO_MESSAGE + r"`down.kernel`, `up.kernel`"):
        ml.get_sharding(model, mesh, TYPO_RULES)
    with pytest.warns(ml.AxisRuleWarning, match=TYPO_MESSAGE + r"the logical names"):
        ml.logical_to_mesh_sharding(P("embed", "hidden"), mesh, TYPO_RULES)
    made_here = pytest.warns(ml.AxisRuleWarning, match=TYPO_MESSAGE + r"a new parameter of shape")
    with ml.use_mesh(mesh), ml.axis_rules(TYPO_RULES), made_here:
        typo_model()


def test_a_typo_is_an_error_with_strict():
    model = typo_model()
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict raises instead of warning
        with pytest.raises(ml.PlanError, match=TYPO_MESSAGE + r"`down.kernel`, `up.kernel`"):
            ml.StateSharding.from_metadata(model, TYPO_RULES, mesh=mesh, strict=True)
        with pytest.raises(ValueError, match=TYPO_MESSAGE):
            ml.get_sharding(model, mesh, TYPO_RULES, strict=True)
        with pytest.raises(ValueError, match=TYPO_MESSAGE):
            ml.logical_to_mesh(("embed", "hidden"), TYPO_RULES, mesh=mesh, strict=True)


def test_a_typo_is_a_problem_of_explain():
    report = ml.explain(typo_model(), TYPO_RULES, {"data": 2, "model": 4})
    assert not report.ok
    assert [path for path, _ in report.problems] == ["down.kernel", "up.kernel"]
    assert all("('hidden', 'modle')" in problem for _, problem in report.problems)
    with pytest.raises(ml.PlanError, match="modle"):
        report.check()


def test_rules_for_another_mesh_are_silent_where_the_mesh_has_their_axes():
    model = typo_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = ml.StateSharding.from_metadata(model, TYPO_RULES, mesh={"data": 2, "modle": 4})
    assert plan.spec_for(("up", "kernel"), model.up.kernel) == P(None, "modle")


# -- ml.eval_shape: nnx.eval_shape renamed, a restore target on the mesh ----------------------


@guide_code
def test_eval_shape_gives_the_abstract_model_flax_gives():
    mesh = auto_mesh((2, 4), ("data", "model"))
    names, rules = GUIDE_CASES["logical names"]
    with ml.use_mesh(mesh), ml.axis_rules(rules):
        abstract = ml.eval_shape(lambda: guide_model(names, ml.with_partitioning))
    with nnx.logical_axis_rules(rules), graph_mode():
        _, flax_state = nnx.get_abstract_model(
            lambda: guide_model(names, nnx.with_partitioning), mesh
        )
    ours = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(abstract))}
    theirs = {p: v.get_value() for p, v in nnx.to_flat_state(flax_state)}
    assert ours == theirs  # ShapeDtypeStructs: shape, dtype and NamedSharding on the mesh
    assert ours[("layers", "w2")].sharding == NamedSharding(mesh, P(None, "model", None))


def test_eval_shape_leaves_its_arguments_and_names_what_the_mesh_cannot_shard():
    layer = nnx.Linear(16, 30, rngs=nnx.Rngs(0))
    kernel = layer.kernel[...]
    out = ml.eval_shape(lambda m, x: m(x), layer, jnp.ones((8, 16)))
    assert out == jax.ShapeDtypeStruct((8, 30), jnp.float32)
    assert layer.kernel[...] is kernel
    init = ml.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    refused = pytest.raises(ml.PlanError, match=r"`kernel` \(shape \(16, 30\).*not divisible")
    with ml.use_mesh(ml.make_mesh({"data": 2, "model": 4})), refused:
        ml.eval_shape(lambda: nnx.Linear(16, 30, kernel_init=init, rngs=nnx.Rngs(0)))


def test_names_set_with_set_metadata_are_mapped_by_an_explicit_rules_argument():
    """The reported case: `set_metadata(out_sharding=("batch", None))`, rules= given."""
    holder = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    holder.kernel.set_metadata(out_sharding=("batch", None))
    rules = [("batch", "data")]
    plan = ml.StateSharding.from_metadata(holder, rules, mesh={"data": 2, "model": 4})
    assert plan.spec_for(("kernel",), holder.kernel) == P("data", None)
    assert ml.get_partition_spec(holder, rules)["kernel"].get_value() == P("data", None)
    with nnx.logical_axis_rules(rules):  # flax's own reading, for the same Variable
        assert nnx.get_partition_spec(nnx.state(holder))["kernel"].get_value() == P("data", None)


# -- generated: meshlift reads names as flax's resolver does ----------------------------------

NAMES = ["data", "model", "embed", "hidden", "mlp", None]
RULE_AXES = ["data", "model", None, ("data", "model")]


@st.composite
def annotations_and_rules(draw):
    """Names of a (8, 8) kernel (mesh axes, logical names, None) and rules for some of them."""
    names = tuple(draw(st.lists(st.sampled_from(NAMES), min_size=2, max_size=2)))
    if names[0] is not None and names[0] == names[1]:
        names = (names[0], None)
    logical = draw(st.lists(st.sampled_from(["embed", "hidden", "mlp", "batch"]), unique=True))
    rules = [(name, draw(st.sampled_from(RULE_AXES))) for name in logical]
    return names, rules, draw(st.booleans())


def _axes(spec):
    return [a for e in spec for a in (e if isinstance(e, tuple) else (e,)) if a is not None]


@oracle.budget(60)
@given(annotations_and_rules())
def test_generated_names_and_rules_read_as_flaxs_resolver_reads_them(case):
    names, rules, in_context = case
    init = ml.with_partitioning(nnx.initializers.lecun_normal(), names)
    layer = nnx.Linear(8, 8, kernel_init=init, rngs=nnx.Rngs(0))
    with nnx.logical_axis_rules(rules):
        flax_spec = nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value()
        ours = ml.get_partition_spec(layer)["kernel"].get_value()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every axis is in the mesh: nothing to report
        mesh = {"data": 2, "model": 4}
        if in_context:
            with ml.axis_rules(rules):
                plan = ml.StateSharding.from_metadata(layer, mesh=mesh)
        else:
            plan = ml.StateSharding.from_metadata(layer, rules, mesh=mesh)
    planned = plan.spec_for(("kernel",), layer.kernel)
    assert planned == ours
    assert len(set(_axes(ours))) == len(_axes(ours))  # never a mesh axis twice
    if len(set(_axes(flax_spec))) == len(_axes(flax_spec)):
        assert ours == flax_spec  # where flax's spec is one JAX takes, it is ours
