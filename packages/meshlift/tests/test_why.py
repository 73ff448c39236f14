"""Why a parameter has its spec: every source (`ml.explain`'s column and `why`), every
reason a dimension is not split, rule names nothing uses, did-you-mean for mesh axes, and
`meshlift plan --why`."""

import json
import re
import sys
import textwrap
import warnings

import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import meshlift as ml
from meshlift.tools.cli import main
from meshlift.tools.tables import Breakable

MESH = {"data": 2, "model": 4}


def linear(names, din=16, dout=64, logical=False):
    if names is None:
        return nnx.Linear(din, dout, rngs=nnx.Rngs(0))
    wrap = ml.with_logical_partitioning if logical else ml.with_partitioning
    init = wrap(nnx.initializers.lecun_normal(), names)
    return nnx.Linear(din, dout, kernel_init=init, rngs=nnx.Rngs(0))


def dims(report, path):
    return report.row(path).why.dimensions


# -- sources -------------------------------------------------------------------------------
def test_a_filter_decides_and_a_later_matching_filter_is_noted():
    plan = ml.StateSharding(
        {nnx.Param: P(), ml.path_endswith("kernel"): P(None, "model"), ...: P()}
    )
    report = ml.explain(linear(None), plan, MESH)
    why = report.row("kernel").why
    assert why.source == "filter 1"
    assert why.decided_by == "filter 1 of 3 in the plan, nnx.Param: P()"
    assert why.notes == (
        "filter 2, path_endswith('kernel') (P(None, 'model')), matches it too, but filter 1 "
        "comes first",
    )
    assert why.dimensions == (
        "dim 0 (size 16): not split, the spec P() splits nothing",
        "dim 1 (size 64): not split, the spec P() splits nothing",
    )
    assert "| filter 1 |" in str(report).replace("│", "|")


def test_the_plans_ellipsis_decides_and_a_filter_like_a_typo_is_noted():
    plan = ml.StateSharding({ml.path_endswith("kernal"): P(None, "model"), ...: P()})
    why = ml.explain(linear(None), plan, MESH).row("kernel").why
    assert why.source == "..."
    assert why.decided_by == "the plan's `...` (no filter before it matches): P()"
    assert why.notes == (
        "filter 1, path_endswith('kernal'), matches no parameter; did you mean 'kernel'?",
    )


def test_a_spec_that_splits_says_how_many_ways_over_which_axes():
    plan = ml.StateSharding({ml.path_endswith("kernel"): P("data", ("model",)), ...: P()})
    assert dims(ml.explain(linear(None), plan, MESH), "kernel") == (
        "dim 0 (size 16): split 2 ways over 'data', by the spec",
        "dim 1 (size 64): split 4 ways over 'model', by the spec",
    )
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, ("data", "model")), ...: P()})
    assert dims(ml.explain(linear(None), plan, MESH), "kernel")[1] == (
        "dim 1 (size 64): split 8 ways over 'data' x 'model', by the spec"
    )


def test_a_filter_with_no_spec_leaves_it_to_the_compiler():
    plan = ml.StateSharding({ml.path_endswith("kernel"): None, ...: P()})
    why = ml.explain(linear(None), plan, MESH).row("kernel").why
    assert why.dimensions == ("every dimension: left to the compiler (no spec)",)


def test_logical_names_decided_by_rules():
    report = ml.explain(linear(("embed", "mlp"), logical=True), [("mlp", "model")], MESH)
    why = report.row("kernel").why
    assert why.source == "rules"
    assert why.decided_by == (
        "the annotation ('embed', 'mlp'), logical names, and the rules: P(None, 'model')"
    )
    assert why.dimensions == (
        "dim 0 (size 16): not split, no rule names the logical name 'embed' (the rules name 'mlp')",
        "dim 1 (size 64): split 4 ways over 'model', by the rule ('mlp', 'model')",
    )


def test_mesh_axes_in_the_annotation_decide():
    why = ml.explain(linear(("data", "model")), None, MESH).row("kernel").why
    assert why.source == "annotation"
    assert why.dimensions == (
        "dim 0 (size 16): split 2 ways over 'data', as the annotation names it",
        "dim 1 (size 64): split 4 ways over 'model', as the annotation names it",
    )


def test_an_unannotated_parameter_is_replicated_and_says_so():
    why = ml.explain(linear(("data", "model")), None, MESH).row("bias").why
    assert why.source == "none"
    assert why.decided_by.startswith("no annotation, so P(): replicated")
    assert why.dimensions == ("dim 0 (size 64): not split, it has no annotation",)


def test_logical_names_without_rules_are_an_error_row():
    report = ml.explain(linear(("embed", "mlp"), logical=True), None, MESH)
    assert report.row("kernel").why.source == "error"
    assert "no axis rules are set" in report.why("kernel")


# -- why a dimension is not split ----------------------------------------------------------
def test_a_rule_that_maps_a_name_to_no_axis():
    report = ml.explain(linear(("embed", "mlp"), logical=True), [("embed", None)], MESH)
    assert dims(report, "kernel")[0] == (
        "dim 0 (size 16): not split, the rule ('embed', None) maps it to no mesh axis"
    )


def test_a_rule_skipped_because_the_mesh_lacks_its_axis():
    report = ml.explain(linear(("embed", "mlp"), logical=True), [("mlp", "modle")], MESH)
    assert dims(report, "kernel")[1] == (
        "dim 1 (size 64): not split, axis rule ('mlp', 'modle') names the mesh axis 'modle' "
        "(did you mean 'model'?), which the mesh {'data': 2, 'model': 4} lacks, so the rule "
        "is skipped"
    )


def test_a_rule_passed_over_because_its_axis_splits_another_dimension():
    rules = [("embed", "model"), ("mlp", "model")]
    report = ml.explain(linear(("embed", "mlp"), logical=True), rules, MESH)
    assert dims(report, "kernel") == (
        "dim 0 (size 16): split 4 ways over 'model', by the rule ('embed', 'model')",
        "dim 1 (size 64): not split, the rule ('mlp', 'model') is passed over: mesh axis "
        "'model' is taken by the rule ('embed', 'model'), for dimension 0",
    )


def test_a_split_that_does_not_divide_is_marked():
    report = ml.explain(linear((None, "model"), dout=30), None, MESH)
    assert dims(report, "kernel")[1] == (
        "dim 1 (size 30): ✗ split 4 ways over 'model', but 30 is not divisible by 4, as the "
        "annotation names it"
    )
    assert not report.ok


def test_the_spec_has_none_there_or_no_entry():
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    assert dims(ml.explain(linear(None), plan, MESH), "kernel")[0] == (
        "dim 0 (size 16): not split, the spec has None there"
    )
    plan = ml.StateSharding({ml.path_endswith("kernel"): P("model"), ...: P()})
    assert dims(ml.explain(linear(None), plan, MESH), "kernel")[1] == (
        "dim 1 (size 64): not split, the spec has 1 entries, none for it"
    )


def test_why_prints_the_parameter_and_its_problems():
    report = ml.explain(linear((None, "model"), dout=30), None, MESH)
    text = report.why("kernel")
    assert text.splitlines()[0] == (
        "kernel: shape (16, 30) float32, P(None, 'model'), on mesh {'data': 2, 'model': 4}"
    )
    assert "problem: dimension 1 (size 30) is not divisible by 4" in text
    with pytest.raises(LookupError, match="did you mean kernel"):
        report.why("kernl")


# -- rule names nothing uses ---------------------------------------------------------------
TYPO = [("embed", None), ("mpl", "model")]
TYPO_TEXT = (
    "axis rule ('mpl', 'model') names the logical name 'mpl', which no parameter has (did "
    "you mean 'mlp'? no rule names it), so the rule does nothing for `kernel`"
)


def test_a_misspelled_logical_name_warns_from_metadata_and_strict_raises():
    model = linear(("embed", "mlp"), logical=True)
    with pytest.warns(ml.AxisRuleWarning) as record:
        plan = ml.StateSharding.from_metadata(model, TYPO)
    assert TYPO_TEXT in str(record[0].message)
    assert plan.spec_for(("kernel",), model.kernel) == P(None, None)  # as the rules say
    with pytest.raises(ml.PlanError, match=re.escape(TYPO_TEXT)):
        ml.StateSharding.from_metadata(model, TYPO, strict=True)
    with pytest.warns(ml.AxisRuleWarning, match=re.escape(TYPO_TEXT)):
        ml.get_sharding(model, ml.make_mesh(MESH), TYPO)


def test_a_misspelled_logical_name_is_a_problem_in_explain():
    report = ml.explain(linear(("embed", "mlp"), logical=True), TYPO, MESH)
    assert report.problems == [
        (
            "kernel",
            "axis rule ('mpl', 'model') names the logical name 'mpl', which no parameter has "
            "(did you mean 'mlp'? no rule names it), so the rule does nothing; it is less "
            "sharded than the rule asks",
        )
    ]
    assert "did you mean 'mpl'?" in dims(report, "kernel")[1]


def test_rule_names_for_activations_are_a_note_not_a_warning():
    model = linear(("embed", "mlp"), logical=True)
    rules = [("batch", "data"), ("mlp", "model")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ml.StateSharding.from_metadata(model, rules, strict=True)
    report = ml.explain(model, rules, MESH)
    assert report.ok
    assert report.warnings == (
        "the rules name 'batch', which no parameter has: fine for activations "
        "(ml.with_logical_constraint), else check the names",
    )


def test_a_parameters_own_rules_map_its_names():
    own = (("embed", None), ("mlp", "model"))
    init = nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("embed", "mlp"), sharding_rules=own
    )
    with ml.use_mesh(ml.make_mesh(MESH)):
        model = nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = ml.StateSharding.from_metadata(model, [("mlpp", "data")], strict=False)
    assert plan.spec_for(("kernel",), model.kernel) == P(None, "model")


# -- did you mean, for mesh axes -----------------------------------------------------------
def test_a_misspelled_mesh_axis_in_an_annotation():
    model = linear((None, "modle"))
    [(path, problem)] = ml.explain(model, None, MESH).problems
    assert path == "kernel" and "mesh axis 'modle' is not in the mesh" in problem
    assert "did you mean 'model'?" in problem
    step = ml.jit(lambda m, x: m(x), in_shardings=(ml.StateSharding.from_metadata(model), P()))
    with pytest.raises(ml.PlanError, match="did you mean 'model'"), ml.use_mesh(ml.make_mesh(MESH)):
        step(model, jnp.ones((8, 16)))


# -- the command line ----------------------------------------------------------------------
MODELS = """
    from flax import nnx
    import meshlift as ml

    def make_mlp():
        init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        return nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))

    class Block(nnx.Module):
        def __init__(self):
            init = ml.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))
            self.attention_output_projection = nnx.Linear(
                4096, 4096, kernel_init=init, rngs=nnx.Rngs(0)
            )

    class Deep(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([Block()])

    def make_deep():
        return Deep()

    def make_annotated():
        init = ml.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        return nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "why_models_cli.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "why_models_cli", raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    return tmp_path


def plan(*argv):
    return main(["plan", *argv])


def test_a_misspelled_rule_exits_1_with_did_you_mean(models, capsys):
    (models / "rules.json").write_text('[["embed", null], ["mpl", "model"]]')
    assert plan("why_models_cli:make_mlp", "--mesh", "data=2,model=4", "--rules", "rules.json") == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "names the logical name 'mpl', which no parameter has (did you mean 'mlp'?" in out


def test_a_misspelled_mesh_axis_in_the_mesh_option(models, capsys):
    assert plan("why_models_cli:make_annotated", "--mesh", "data=2,modle=4") == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "mesh axis 'model' is not in the mesh (axes ['data', 'modle']); did you mean 'modle'?"
        in out
    )


def test_plan_why_prints_the_reasons(models, capsys):
    (models / "rules.json").write_text('[["embed", null], ["mlp", "model"]]')
    argv = ["why_models_cli:make_mlp", "--mesh", "data=2,model=4", "--rules", "rules.json"]
    assert plan(*argv, "--why", "kernel", "--why", "bias") == 0
    out = capsys.readouterr().out
    assert (
        "kernel: shape (16, 64) float32, P(None, 'model'), on mesh {'data': 2, 'model': 4}\n"
        "decided by: the annotation ('embed', 'mlp'), logical names, and the rules: "
        "P(None, 'model')\n"
        "  dim 0 (size 16): not split, the rule ('embed', None) maps it to no mesh axis\n"
        "  dim 1 (size 64): split 4 ways over 'model', by the rule ('mlp', 'model')\n"
    ) in out
    assert "bias: shape (64,) float32, P(), on mesh" in out
    assert plan(*argv, "--why", "kernel", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["why"][0].startswith("kernel: shape (16, 64)")
    [kernel] = [r for r in data["rows"] if r["path"] == "kernel"]
    assert kernel["source"] == "rules" and len(kernel["why"]["dimensions"]) == 2


def test_plan_why_of_a_missing_path_is_a_usage_error(models, capsys):
    assert plan("why_models_cli:make_annotated", "--mesh", "data=2,model=4", "--why", "kernl") == 2
    err = capsys.readouterr().err
    assert "error: --why 'kernl': no parameter 'kernl' on this plan; did you mean kernel?" in err
    assert "hint: write a path as the table's first column shows it" in err


# -- tables fold between words -------------------------------------------------------------
def first_cells(text):
    """The first column's fragments, row by row, of a rich table printed as text."""
    return [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]


def test_a_narrow_table_folds_paths_only_after_dots():
    table = Table("path", "spec")
    table.add_row(Breakable("layers.0.attention.query.kernel"), Breakable("P(None, 'model')"))
    console = Console(width=30, color_system=None, record=True)
    console.print(table)
    cells = first_cells(console.export_text())
    assert len(cells) > 1 and "".join(cells) == "layers.0.attention.query.kernel"
    assert all(cell.endswith(".") for cell in cells[:-1])


def test_the_plan_table_keeps_paths_whole_when_piped(models, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # what rich gives a pipe
    assert plan("why_models_cli:make_deep", "--mesh", "data=2,model=4") == 0
    cells = first_cells(capsys.readouterr().out)
    paths, path = [], ""
    for cell in cells:
        path += cell
        if not cell.endswith("."):
            paths.append(path)
            path = ""
    assert paths == [
        "blocks.0.attention_output_projection.bias",
        "blocks.0.attention_output_projection.kernel",
    ]


def test_a_sharding_plan_given_as_named_shardings_says_so():
    mesh = ml.make_mesh(MESH)
    plan = ml.StateSharding({ml.path_endswith("kernel"): NamedSharding(mesh, P("data")), ...: P()})
    assert dims(ml.explain(linear(None), plan, mesh), "kernel")[0] == (
        "dim 0 (size 16): split 2 ways over 'data', by the spec"
    )


# -- every line agrees with the spec, for drawn names and rules ----------------------------
REASONS = (
    "by the rule",
    "maps it to no mesh axis",
    "no rule names the logical name",
    "so the rule is skipped",
    "is passed over",
    "the annotation has None there",
)


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(st.sampled_from(["embed", "mlp", "heads", None]), min_size=2, max_size=2).filter(
        lambda n: len({x for x in n if x}) == len([x for x in n if x])
    ),
    rules=st.lists(
        st.tuples(
            st.sampled_from(["embed", "mlp", "heads", "mpl", "batch"]),
            st.sampled_from(["data", "model", "modle", None]),
        ),
        min_size=1,
        max_size=4,
    ),
    shape=st.tuples(st.sampled_from([4, 6, 8]), st.sampled_from([4, 6, 8])),
)
def test_each_dimension_line_agrees_with_the_spec_and_a_real_placement(names, rules, shape):
    init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), tuple(names))
    model = nnx.eval_shape(lambda: nnx.Linear(*shape, kernel_init=init, rngs=nnx.Rngs(0)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ml.AxisRuleWarning)
        report = ml.explain(model, rules, MESH)
    row = report.row("kernel")
    assert row.why.source == ("rules" if any(names) else "annotation")
    entries = list(row.spec) + [None] * (2 - len(row.spec))
    for dim, (line, entry) in enumerate(zip(row.why.dimensions, entries, strict=True)):
        assert line.startswith(f"dim {dim} (size {shape[dim]}): ")
        if entry is None:
            assert "not split" in line and any(reason in line for reason in REASONS), line
            continue
        ways = MESH[entry]
        divides = shape[dim] % ways == 0
        assert (f"split {ways} ways over {entry!r}" in line) and (("✗" in line) != divides)
        assert (
            any(f"dimension {dim} (size {shape[dim]}) is not divisible" in p for p in row.problems)
            != divides
        )
    if not row.problems:  # what a real placement does: the spec the row shows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ml.AxisRuleWarning)
            placed = ml.get_sharding(model, ml.make_mesh(MESH), rules)
        assert placed["kernel"].get_value().spec == row.spec
