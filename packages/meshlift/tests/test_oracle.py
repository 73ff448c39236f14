"""The differential oracle over the core, and the oracle's own teeth.

Generated programs of arrays run under `ml.jit` and `jax.jit`; generated
programs of modules run under `ml.jit` and eagerly, with meshlift's fast
paths checked against its slow path, and with the fast paths off and the C
loops replaced by their Python twins. Each backend's own run is in its
conformance kit (`TestConformance.test_generated_programs_run_as_they_run_eagerly`).
"""

import copy

import pytest
from hypothesis import given

import meshlift as ml
from meshlift.testing import oracle
from meshlift.testing.oracle.programs import WHEN_LENGTH_1
from meshlift.testing.oracle.runner import EAGER, Lifting


@oracle.budget(150)
@given(oracle.array_programs())
def test_jit_over_arrays_is_jax_jit(program):
    # outputs with their dtypes and weak types, deleted arrays, trace counts and errors
    oracle.check(program, "ml.jit", reference="jax.jit")


@oracle.budget(80)
@given(oracle.graph_programs())
def test_jit_runs_generated_programs_as_eager_with_its_fast_paths_checked(program):
    oracle.check(program, "ml.jit+checked")


@oracle.budget(40)
@given(oracle.graph_programs())
def test_jit_on_its_slow_path_in_python_runs_them_as_eager(program):
    oracle.check(program, "ml.jit+slow+python")


@oracle.budget(30)
@given(oracle.graph_programs())
def test_jit_with_a_plan_places_outputs_on_its_fast_paths_as_on_its_slow_path(program):
    # the same outputs, state and identities, and each output placed alike
    oracle.check(program, "jit", reference="jit+slow")


# -- the oracle finds what is wrong --------------------------------------------------------

# Variables given values of another structure between calls: a call reusing the layout
# made for the old values ran on its shardings (found by the test above).
RESTRUCTURED = oracle.Program(
    (
        "m0 = Box(w0=nnx.Param(grid((2, 8), 0.5)), t0=nnx.Param(nested(1.0)))",
        "rec.start(m0=m0)",
        "def fn(a):",
        "    return probe((a,))",
        "f = rec.lift(fn)",
        "rec.call(f, m0)",
        "restructure(m0, 'w0', 0.5)",
        "restructure(m0, 't0', 0.5)",
        "rec.call(f, m0)",
        "restructure(m0, 'w0', 0.5)",
        "rec.call(f, m0)",
    )
)


# A Variable given a new value, then left out of the graph (its module replaced) while
# another model still holds it: only Variables still in the graph were written back
# (found by `nox -s fuzz`).
DETACHED = oracle.Program(
    (
        "m0 = Box(w0=nnx.Param(grid((2, 8), 0.0)), sub=Box(w0=nnx.Param(grid((2, 8), 0.0))))",
        "m1 = Box(w0=nnx.Param(grid((2, 8), 0.0)))",
        "m1.shared = m0.sub",
        "rec.start(m0=m0, m1=m1)",
        "def fn(a, b):",
        "    args = (a, b)",
        "    bump(node(args, 0), 'sub.w0', 0.0)",
        "    alias(node(args, 0), 'sub', 'w0')",
        "    return probe(args)",
        "f = rec.lift(fn)",
        "rec.call(f, m0, m0)",
    )
)


# A static value changed in place inside the function, on every call: each call runs the
# Python again, as eagerly (it was refused; optax's cosine schedules do this on first use).
TOUCHED_INSIDE = oracle.Program(
    (
        "m0 = Box(w0=nnx.Param(grid((2, 8), 0.5)), k0=Config(2.0))",
        "rec.start(m0=m0)",
        "def fn(a, x):",
        "    args = (a, x)",
        "    touch(node(args, 0), 'k0')",
        "    return probe(args)",
        "f = rec.lift(fn)",
        *["rec.call(f, m0, grid((8,), 0.0))"] * 3,
    )
)


# Several Variables written back by a repeated call's C step, then a call like the last
# whose program traces again for an argument of another length and changes a static value
# there only (the C step once wrote its outputs to its targets in reverse order, found by
# the conformance kit; the repeated call now adopts the trace's change).
REPEATED = oracle.Program(
    (
        "m0 = Box(w0=nnx.Param(grid((2, 8), 0.5)), b0=nnx.Param(grid((8,), 0.25)),"
        " b1=Stat(grid((8,), 1.0)), k0=[1.0])",
        "rec.start(m0=m0)",
        "def fn(a, x):",
        "    args = (a, x)",
        *(
            f"    bump(node(args, 0), {name!r}, {by})"
            for name, by in (("b1", 0.5), ("w0", 0.25), ("b0", 1.0))
        ),
        f"    touch(node(args, 0), 'k0'{WHEN_LENGTH_1})",
        "    return probe(args)",
        "f = rec.lift(fn)",
        *["rec.call(f, m0, grid((8,), 0.0))"] * 3,
        *["rec.call(f, m0, grid((1,), 0.0))"] * 2,
        "rec.call(f, m0, grid((8,), 0.0))",
    )
)


@pytest.mark.parametrize("target", ["ml.jit+checked", "ml.jit+slow+python", "jit"])
@pytest.mark.parametrize(
    "program", [DETACHED, TOUCHED_INSIDE, REPEATED], ids=["detached", "touched", "repeated"]
)
def test_fixed_programs_run_as_eagerly(program, target):
    oracle.check(program, target)


def test_restructured_variables_run_on_the_fast_paths_as_on_the_slow_path():
    oracle.check(RESTRUCTURED, "jit", reference="jit+slow")
    oracle.check(RESTRUCTURED, "jit+checked")


def test_two_meshlift_runs_placing_outputs_otherwise_are_told_apart():
    problems = oracle.compare(RESTRUCTURED, oracle.lifting("jit"), oracle.lifting("ml.jit"))
    assert any("is placed" in line for line in problems), problems


SWAP_AND_CONFIG = oracle.Program(
    (
        "m0 = Box(w0=nnx.Param(grid((2, 8), 0.5)), w1=nnx.Param(grid((2, 8), 1.0)), "
        "k0=Config(2.0))",
        "rec.start(m0=m0)",
        "def fn(a, x):",
        "    args = (a, x)",
        "    bump(node(args, 0), 'w0', 1.0)",
        "    swap(node(args, 0), 'w0', 'w1')",
        "    return probe(args)",
        "f = rec.lift(fn)",
        "rec.call(f, m0, grid((8,), 0.0))",
        "touch(m0, 'k0')",
        "rec.call(f, m0, grid((8,), 0.0))",
    )
)


def test_a_program_that_agrees_gives_no_difference():
    assert oracle.compare(SWAP_AND_CONFIG, oracle.lifting("ml.jit")) == []


def _on_copies(fn, **options):
    """A broken transform: runs the function on copies, so nothing is written back."""
    return lambda *args: fn(*copy.deepcopy(args))


class _Stale:
    """A broken transform: the first call's output forever (a stale cache)."""

    def __init__(self, fn, **options):
        self.fn, self.out = fn, None

    def __call__(self, *args):
        if self.out is None:
            self.out = self.fn(*args)
        return self.out


@pytest.mark.parametrize(("broken", "symptom"), [(_on_copies, "state `m0.w"), (_Stale, "output")])
def test_a_broken_transform_is_told_apart_from_eager(broken, symptom):
    problems = oracle.compare(SWAP_AND_CONFIG, Lifting("broken", broken))
    assert any(line.startswith(symptom) for line in problems), problems


def test_a_refusal_is_a_difference_as_a_wrong_answer_is():
    def refusing(fn, **options):
        def call(*args):
            raise ml.StructureChangedError("refused: `a.k0` was changed in place")

        return call

    problems = oracle.compare(SWAP_AND_CONFIG, Lifting("refusing", refusing), EAGER)
    assert problems[-1].startswith("raised StructureChangedError")


def test_a_failure_shows_a_snippet_and_a_snippet_runs(capsys):
    with pytest.raises(AssertionError, match="broken differs from eager") as failure:
        oracle.check(SWAP_AND_CONFIG, Lifting("broken", _on_copies))
    snippet = str(failure.value).split("To reproduce:\n\n", 1)[1]
    assert SWAP_AND_CONFIG.source() in snippet
    assert "replay(program, 'broken', 'eager')" in snippet
    exec(oracle.snippet(SWAP_AND_CONFIG, "ml.jit"), {})
    assert capsys.readouterr().out == "ml.jit agrees with eager\n"
