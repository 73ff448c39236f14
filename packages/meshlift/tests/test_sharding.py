"""StateSharding plans, path filters and spec validation, on real NNX modules and meshes."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.errors import PlanError
from meshlift.paths import format_path
from meshlift.plans.resolve import to_sharding
from meshlift.plans.sharding import path_endswith
from meshlift.plans.specs import spec_problems

MESH_SHAPE = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh(MESH_SHAPE)


class Net(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.linear = nnx.Linear(2, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)])
        self.rngs = nnx.Rngs(params=0, dropout=1)


def resolve(plan, node):
    """``{"a.b": spec}`` for every Variable of ``node``, as a lifted call resolves them."""
    return {
        format_path(path): plan.spec_for(path, value)
        for path, value in nnx.graph.iter_graph(node)
        if isinstance(value, nnx.Variable)
    }


@pytest.fixture(scope="module")
def net():
    return Net()


# -- format_path and path_endswith ---------------------------------------------


def test_format_path():
    assert format_path(("model", "layers", 0, "kernel")) == "model.layers.0.kernel"
    assert format_path(()) == "<root>"


def test_path_endswith_matches_whole_trailing_components():
    f = path_endswith("linear", "kernel")
    assert f(("model", "linear", "kernel"))
    assert f(("linear", "kernel"))
    assert not f(("model", "linear", "bias"))
    assert not f(("model", "nonlinear", "kernel"))  # "linear" is a whole component
    assert not f(("kernel",))  # path shorter than the filter
    assert not path_endswith("kernel")(("my_kernel",))


def test_path_endswith_with_list_indices():
    assert path_endswith("layers", 1, "kernel")(("layers", 1, "kernel"))
    assert not path_endswith("layers", 1, "kernel")(("layers", 0, "kernel"))
    assert path_endswith(0, "bias")(("layers", 0, "bias"))
    assert path_endswith("0", "bias")(("layers", 0, "bias"))  # a string index matches too
    assert path_endswith(0, "bias") == path_endswith("0", "bias")
    assert hash(path_endswith("a", 1)) == hash(path_endswith("a", 1))
    assert path_endswith("a") != path_endswith("b")
    assert repr(path_endswith("layers", 0)) == "path_endswith('layers', '0')"


def test_path_endswith_needs_a_part():
    with pytest.raises(
        TypeError, match=r"at least one path part, e\.g\. path_endswith\('kernel'\)"
    ):
        path_endswith()


# -- StateSharding rules -------------------------------------------------------


def test_first_match_wins_and_order_matters(net):
    kernel_first = ml.StateSharding(
        {path_endswith("kernel"): P(None, "model"), nnx.Param: P(), ...: P()}
    )
    param_first = ml.StateSharding(
        {nnx.Param: P(), path_endswith("kernel"): P(None, "model"), ...: P()}
    )

    assert kernel_first.spec_for(("linear", "kernel"), net.linear.kernel) == P(None, "model")
    assert kernel_first.spec_for(("linear", "bias"), net.linear.bias) == P()
    assert param_first.spec_for(("linear", "kernel"), net.linear.kernel) == P()


def test_rules_as_pairs_keep_their_order_even_with_repeated_filters(net):
    plan = ml.StateSharding([(nnx.Param, P("data")), (nnx.Param, P()), (..., None)])
    assert plan.spec_for(("linear", "bias"), net.linear.bias) == P("data")
    assert plan.spec_for(("norm", "mean"), net.norm.mean) is None


def test_ellipsis_catches_everything_else(net):
    plan = ml.StateSharding({path_endswith("layers", 0, "kernel"): P(None, "model"), ...: P()})
    specs = resolve(plan, net)
    assert specs.pop("layers.0.kernel") == P(None, "model")
    assert len(specs) == 13  # linear 2, norm 4, layers 4, rngs 4, less layers.0.kernel
    assert set(specs.values()) == {P()}


def test_variable_type_filter(net):
    plan = ml.StateSharding({nnx.BatchStat: P("data"), nnx.Param: P(None), ...: None})
    specs = resolve(plan, net)
    assert specs["norm.mean"] == specs["norm.var"] == P("data")
    assert specs["norm.scale"] == specs["linear.kernel"] == P(None)
    assert specs["rngs.dropout.key"] is None


def test_string_filter_is_a_tag(net):
    plan = ml.StateSharding({"dropout": P(), ...: None})
    specs = resolve(plan, net)
    assert specs["rngs.dropout.key"] == specs["rngs.dropout.count"] == P()
    assert specs["rngs.params.key"] is None
    assert specs["linear.kernel"] is None


def test_all_any_not_filters(net):
    plan = ml.StateSharding(
        {
            nnx.All(nnx.Param, path_endswith("kernel")): P(None, "model"),
            nnx.Any(nnx.BatchStat, path_endswith("bias")): P("model"),
            nnx.Not(nnx.Param): P("data"),
            ...: P(),
        }
    )
    specs = resolve(plan, net)
    assert specs["linear.kernel"] == specs["layers.1.kernel"] == P(None, "model")
    assert specs["linear.bias"] == specs["norm.mean"] == P("model")
    assert specs["rngs.params.key"] == P("data")
    assert specs["norm.scale"] == P()


def test_a_predicate_function_is_a_filter(net):
    plan = ml.StateSharding(
        {lambda path, value: value.get_raw_value().ndim == 2: P("data"), ...: P()}
    )
    assert plan.spec_for(("linear", "kernel"), net.linear.kernel) == P("data")
    assert plan.spec_for(("linear", "bias"), net.linear.bias) == P()


def test_no_match_names_the_path_and_says_how_to_fix(net):
    plan = ml.StateSharding({nnx.BatchStat: P()})
    with pytest.raises(PlanError) as info:
        plan.spec_for(("layers", 0, "kernel"), net.layers[0].kernel)
    message = str(info.value)
    assert "`layers.0.kernel`" in message
    assert "Param, shape (8, 8)" in message
    assert "BatchStat" in message  # lists the plan's filters
    assert "end the plan with `...: P()`" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        (("data", None), "is a tuple ('data', None); wrap it: PartitionSpec('data', None)"),
        (["data", None], "is a list ['data', None]; wrap it: PartitionSpec('data', None)"),
        ((("data", "model"),), "wrap it: PartitionSpec(('data', 'model'),)"),
    ],
    ids=["tuple", "list", "nested tuple"],
)
def test_spec_given_as_a_sequence_says_to_wrap_it(spec, fix):
    with pytest.raises(TypeError) as info:
        ml.StateSharding({path_endswith("kernel"): spec})
    assert fix in str(info.value)
    assert "path_endswith('kernel')" in str(info.value)


def test_spec_of_another_type_is_rejected():
    with pytest.raises(
        TypeError, match=r"must be a PartitionSpec, NamedSharding or None, got str: 'data'"
    ):
        ml.StateSharding({nnx.Param: "data"})


def test_named_sharding_and_none_are_specs(mesh, net):
    named = NamedSharding(mesh, P("data"))
    plan = ml.StateSharding({nnx.BatchStat: named, ...: None})
    assert plan.spec_for(("norm", "mean"), net.norm.mean) is named
    assert plan.spec_for(("linear", "kernel"), net.linear.kernel) is None


# -- from_state ----------------------------------------------------------------


def test_from_state_nested_dict_broadcasts_inner_specs(net):
    plan = ml.StateSharding.from_state(
        {
            "linear": {"kernel": P(None, "model"), "bias": P("model")},
            "layers": P(),  # applies to everything below
            "norm": {"mean": P("data")},
        }
    )
    assert plan.spec_for(("linear", "kernel"), net.linear.kernel) == P(None, "model")
    assert plan.spec_for(("linear", "bias"), net.linear.bias) == P("model")
    assert plan.spec_for(("layers", 0, "kernel"), net.layers[0].kernel) == P()
    assert plan.spec_for(("layers", 1, "bias"), net.layers[1].bias) == P()
    assert plan.spec_for(("norm", "mean"), net.norm.mean) == P("data")
    with pytest.raises(PlanError, match=r"`norm\.var`.*`\.\.\.: P\(\)`"):
        plan.spec_for(("norm", "var"), net.norm.var)
    # a prefix matches whole components: "linear" does not cover "linear2"
    with pytest.raises(PlanError, match=r"`linear2\.kernel`"):
        plan.spec_for(("linear2", "kernel"), net.linear.kernel)


@pytest.mark.parametrize("deep_first", [True, False], ids=["deep-first", "shallow-first"])
def test_from_state_deeper_entries_win_over_an_inner_spec(net, deep_first):
    # nnx.state() keys nnx.List entries by int, users often write "0": both name layers.0.
    entries = [(0, {"kernel": P(None, "model")}), ("0", P("data"))]
    if not deep_first:
        entries.reverse()
    plan = ml.StateSharding.from_state({"layers": dict(entries), "linear": P()})
    assert plan.spec_for(("layers", 0, "kernel"), net.layers[0].kernel) == P(None, "model")
    assert plan.spec_for(("layers", 0, "bias"), net.layers[0].bias) == P("data")
    assert plan.spec_for(("linear", "kernel"), net.linear.kernel) == P()


def test_from_state_with_an_nnx_state_of_specs(net):
    state = nnx.State({"layers": {0: {"kernel": P(None, "model")}, 1: P("data")}, "linear": P()})
    plan = ml.StateSharding.from_state(state)
    assert plan.spec_for(("layers", 0, "kernel"), net.layers[0].kernel) == P(None, "model")
    assert plan.spec_for(("layers", 1, "kernel"), net.layers[1].kernel) == P("data")
    assert plan.spec_for(("linear", "bias"), net.linear.bias) == P()


@pytest.mark.parametrize("wrap", [nnx.State, dict], ids=["nnx.State", "nested dict"])
def test_the_constructor_takes_specs_shaped_like_the_model_as_flax_does(net, mesh, wrap):
    specs = {"linear": {"kernel": P(None, "model"), "bias": P("model")}, "layers": P()}
    specs |= {"norm": P("data"), "rngs": P()}
    plan = ml.StateSharding(wrap(specs))
    assert plan.spec_for(("linear", "kernel"), net.linear.kernel) == P(None, "model")
    assert plan.spec_for(("layers", 1, "bias"), net.layers[1].bias) == P()
    assert plan.spec_for(("norm", "mean"), net.norm.mean) == P("data")
    model = Net()
    ml.jit(lambda m: None, in_shardings=(plan,), mesh=mesh)(model)
    assert model.linear.kernel[...].sharding.spec == P(None, "model")  # placed by the plan
    assert model.norm.mean[...].sharding.spec == P("data")


def test_a_string_filter_that_matches_nothing_says_it_is_a_tag(net):
    plan = ml.StateSharding({"kernel": P(None, "model")})
    with pytest.raises(PlanError, match=r"`linear\.kernel`.*matches a Variable's tag"):
        plan.spec_for(("linear", "kernel"), net.linear.kernel)


def test_from_state_of_a_models_partition_specs(mesh):
    with ml.use_mesh(mesh):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        model = nnx.Linear(2, 8, kernel_init=init, rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model))
    assert isinstance(specs, nnx.State)
    plan = ml.StateSharding.from_state(specs)
    assert plan.spec_for(("kernel",), model.kernel) == P(None, "model")
    assert plan.spec_for(("bias",), model.bias) == P()


def test_from_state_rejects_a_tuple_leaf():
    with pytest.raises(TypeError, match=r"wrap it: PartitionSpec\('data', None\)"):
        ml.StateSharding.from_state({"linear": {"kernel": ("data", None)}})


# -- spec_problems ---------------------------------------------------------------


def test_spec_problems_empty_for_a_valid_spec():
    assert spec_problems(P("data", "model"), (4, 8), MESH_SHAPE) == []
    assert spec_problems(P(("data", "model")), (16,), MESH_SHAPE) == []
    assert spec_problems(P(None, P.UNCONSTRAINED), (3, 5), MESH_SHAPE) == []
    assert spec_problems(P(), (), MESH_SHAPE) == []


def test_spec_problems_rank_too_long():
    assert spec_problems(P("data", None, None), (2, 4), MESH_SHAPE) == [
        "the spec has 3 entries but the array has rank 2; use at most 2 entries"
    ]


def test_spec_problems_unknown_axis():
    assert spec_problems(P("batch"), (4,), MESH_SHAPE) == [
        "mesh axis 'batch' is not in the mesh (axes ['data', 'model']); did you forget to "
        "declare the mesh? Use one of its axis names or a mesh that has it"
    ]


def test_spec_problems_axis_used_twice():
    assert spec_problems(P("model", "model"), (4, 8), MESH_SHAPE) == [
        "mesh axis 'model' is used twice: a single sharding specification can map every mesh axis to at most one positional dimension"
    ]
    assert spec_problems(P(("data", "data")), (8,), MESH_SHAPE) == [
        "mesh axis 'data' is used twice: a single sharding specification can map every mesh axis to at most one positional dimension"
    ]


def test_spec_problems_non_divisible_dimension():
    assert spec_problems(P(None, "model"), (2, 6), MESH_SHAPE) == [
        "dimension 1 (size 6) is not divisible by 4, the size of mesh axes ('model',); "
        "pad the array or choose other axes"
    ]
    assert spec_problems(P(("data", "model")), (4,), MESH_SHAPE) == [
        "dimension 0 (size 4) is not divisible by 8, the size of mesh axes ('data', 'model'); "
        "pad the array or choose other axes"
    ]


def test_spec_problems_reports_every_problem():
    problems = spec_problems(P("batch", "model", "data"), (3, 6), MESH_SHAPE)
    assert len(problems) == 3
    assert problems[0].startswith("the spec has 3 entries but the array has rank 2")
    assert "mesh axis 'batch' is not in the mesh" in problems[1]
    assert problems[2].startswith("dimension 1 (size 6) is not divisible by 4")


def test_spec_problems_without_a_shape_checks_only_the_axes():
    assert spec_problems(P(None, "model"), None, MESH_SHAPE) == []
    assert spec_problems(P("batch"), None, MESH_SHAPE) == [
        "mesh axis 'batch' is not in the mesh (axes ['data', 'model']); did you forget to "
        "declare the mesh? Use one of its axis names or a mesh that has it"
    ]


# -- to_sharding -----------------------------------------------------------------


def test_to_sharding_resolves_a_spec_on_the_mesh(mesh):
    sharding = to_sharding(P(None, "model"), mesh, "linear.kernel", jnp.zeros((2, 8)))
    assert isinstance(sharding, NamedSharding)
    assert sharding.mesh == mesh
    assert sharding.spec == P(None, "model")
    assert to_sharding(None, mesh, "linear.kernel", jnp.zeros((2, 8))) is None


def test_to_sharding_reads_a_variables_shape(mesh):
    kernel = nnx.Param(jnp.zeros((8, 2)))
    assert to_sharding(P("model"), mesh, "k", kernel).spec == P("model")
    with pytest.raises(PlanError, match=r"cannot shard `k` \(shape \(8, 2\)\)"):
        to_sharding(P(None, "model"), mesh, "k", kernel)


@pytest.mark.parametrize(
    ("spec", "shape", "problem"),
    [
        (P(None, "model"), (2, 3), "dimension 1 (size 3) is not divisible by 4"),
        (P("data", None, None), (2, 4), "the spec has 3 entries but the array has rank 2"),
        (P("bogus"), (2, 4), "mesh axis 'bogus' is not in the mesh"),
        (P("data", "data"), (2, 4), "mesh axis 'data' is used twice"),
    ],
    ids=["not divisible", "rank", "unknown axis", "axis twice"],
)
def test_to_sharding_error_names_path_shape_spec_and_mesh(mesh, spec, shape, problem):
    with pytest.raises(PlanError) as info:
        to_sharding(spec, mesh, "model.linear.kernel", jnp.zeros(shape))
    message = str(info.value)
    assert message.startswith(
        f"cannot shard `model.linear.kernel` (shape {shape}) with sharding {spec} "
        f"on mesh {{'data': 2, 'model': 4}}: "
    )
    assert problem in message


def test_bare_spec_without_a_mesh_says_to_use_a_mesh():
    with pytest.raises(PlanError) as info:
        to_sharding(P("data"), None, "batch.x", jnp.zeros((4,)))
    message = str(info.value)
    assert "`batch.x`" in message
    assert "P('data',)" in message
    assert "pass mesh= to the transform" in message
    assert "with ml.use_mesh(mesh):" in message


def test_named_sharding_passes_through(mesh):
    named = NamedSharding(mesh, P("data"))
    assert to_sharding(named, None, "x", jnp.zeros((4,))) is named
    other = ml.make_mesh({"x": 8})
    assert to_sharding(named, other, "x", jnp.zeros((4,))) is named  # its own mesh wins


def test_invalid_named_sharding_is_checked_on_its_own_mesh(mesh):
    named = NamedSharding(mesh, P("model"))
    with pytest.raises(PlanError) as info:
        to_sharding(named, ml.make_mesh({"x": 8}), "x", jnp.zeros((6,)))
    assert str(info.value).startswith(
        "cannot shard `x` (shape (6,)) with sharding P('model',) on mesh {'data': 2, 'model': 4}: "
        "dimension 0 (size 6) is not divisible by 4"
    )


def test_unknown_shape_checks_only_the_axes(mesh):
    assert to_sharding(P(None, "model"), mesh, "out", None).spec == P(None, "model")
    with pytest.raises(PlanError, match=r"`out`.*mesh axis 'batch' is not in the mesh"):
        to_sharding(P("batch"), mesh, "out", None)


def test_other_shardings_pass_through(mesh):
    single = SingleDeviceSharding(jax.devices()[0])
    assert to_sharding(single, mesh, "x", jnp.zeros((3,))) is single


def test_a_filter_that_matches_nothing_warns_naming_it():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    typo = ml.path_endswith("linear9", "kernel")
    plan = ml.StateSharding({typo: P(None, "model"), ml.path_endswith("bias"): P(), ...: P()})
    forward = ml.jit(lambda m, x: m(x), in_shardings=(plan, P()), mesh=mesh)
    with pytest.warns(UserWarning, match=r"filter path_endswith\('linear9', 'kernel'\)") as caught:
        forward(layer, jnp.ones((2, 4)))
    assert len(caught) == 1  # the bias filter matched, and ... is the catch-all
    assert "of the plan in in_shardings matches none of `m.bias`, `m.kernel`" in str(
        caught[0].message
    )
