"""The repository's conftest.py: tree mode runs the tests whose run reads flax's
graph-mode flag, found by a graph-mode run that records them."""

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = """
import pytest
from flax import nnx

@pytest.fixture(scope="module")
def split_model():
    return nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))  # reads the flag

def test_reads():
    nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))

def test_reads_through_its_fixture(split_model):
    assert split_model

def test_arithmetic():
    assert 1 + 1 == 2

def test_under_graph_mode():
    with nnx.set_graph_mode(True):  # as meshlift's calls do: the flag is not read
        nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
"""


def project(pytester):
    """A project of its own (its ini: no conftest.py above it is read, wherever the
    temporary folder is, as under nox's, inside this repository) with this conftest.py."""
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_models=TESTS)


def test_tree_mode_runs_the_tests_that_read_the_flag(pytester):
    project(pytester)
    pytester.makepyfile(test_models=TESTS)
    folder = pytester.path / "readers"
    pytester.runpytest_subprocess(f"--graph-mode-readers=record:{folder}").assert_outcomes(passed=4)
    assert (folder / "main.txt").read_text().splitlines() == [
        "fixture test_models.py::split_model",
        "test test_models.py::test_reads",
        "test test_models.py::test_reads_through_its_fixture",
    ]
    selected = pytester.runpytest_subprocess(f"--graph-mode-readers=only:{folder}", "-v")
    selected.assert_outcomes(passed=2, deselected=2)
    selected.stdout.fnmatch_lines(
        ["*test_reads PASSED*", "*test_reads_through_its_fixture PASSED*"]
    )


def test_selecting_without_a_record_is_a_usage_error(pytester):
    project(pytester)
    result = pytester.runpytest_subprocess(f"--graph-mode-readers=only:{pytester.path / 'none'}")
    assert result.ret == 4  # pytest's usage error
    result.stderr.fnmatch_lines(["*found no record there*record:*first*"])
