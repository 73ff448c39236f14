"""`import meshlift` and the command line start without jax: public names load lazily.

`meshlift --help` and `meshlift backends` answer without importing jax or flax (a second
or more on their own), and every public name still resolves, for users and type checkers.
"""

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import meshlift as ml

HEAVY = ("jax", "jaxlib", "flax", "numpy", "optax")

REPORT = f"""
import json, sys
from meshlift.tools.cli import main
status = main(sys.argv[1:])
heavy = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps({{"status": status, "heavy": heavy}}), file=sys.stderr)
"""


def run_cli(*argv: str) -> dict:
    """Run the command line in a fresh process; its status and the heavy modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-c", REPORT, *argv], capture_output=True, text=True, timeout=120
    )
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["backends"], ["backends", "--help"], ["plan", "--help"], ["plan", "x:y"]],
    ids=["help", "backends", "backends-help", "plan-help", "plan-usage-error"],
)
def test_the_command_line_answers_without_importing_jax(argv):
    result = run_cli(*argv)
    assert result["status"] in (0, 2)
    assert result["heavy"] == [], f"meshlift {' '.join(argv)} imported {result['heavy']}"


def test_backends_check_does_import_the_plugins():
    """The positive control: --check loads the plugins, which import jax."""
    result = run_cli("backends", "--check")
    assert result["status"] == 0 and "jax" in result["heavy"]


def test_import_meshlift_cli_imports_no_jax():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import meshlift.tools.cli"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "meshlift.tools.cli" in imported
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(imported)


def test_every_public_name_resolves():
    for name in ml.__all__:
        assert getattr(ml, name) is not None, name
    assert callable(ml.jit) and callable(ml.shard_map) and callable(ml.pjit)
    assert ml.StateSharding.__module__ == "meshlift.plans.sharding"
    assert ml.plugins.__name__ == "meshlift.plugins"
    assert ml.__version__
    assert set(ml.__all__) <= set(dir(ml))
    from meshlift import Explanation, explain, make_mesh  # from-imports resolve too

    assert callable(explain) and callable(make_mesh) and Explanation.__name__ == "Explanation"


def test_the_lifted_front_ends_still_work():
    import jax.numpy as jnp

    assert ml.jit(lambda x: 2 * x)(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="has no attribute 'jti'"):
        ml.jti  # noqa: B018
    assert not hasattr(ml, "no.such.name")


def test_no_public_name_is_also_a_submodule():
    """A public name that is also a submodule (`meshlift.explain` was both) is bound to the
    module whenever the submodule is imported; the functions live in subpackages instead,
    and `ml.plugins` is the one public module."""
    both = [n for n in ml.__all__ if importlib.util.find_spec(f"meshlift.{n}") is not None]
    assert both == ["plugins"]
    code = (
        "from meshlift.tools.explain import Row\n"
        "import meshlift as ml\n"
        "assert callable(ml.explain) and ml.explain.__name__ == 'explain', ml.explain\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_lazy_names_type_checking_imports_and_all_agree():
    """A public name is in `_LAZY`, imported under TYPE_CHECKING (for type checkers), and in
    `__all__`; the three lists must not drift apart. The front ends are defined here and
    typed by a stub of their backends' signatures."""
    source = Path(ml.__file__).read_text()
    tree = ast.parse(source)
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    for alias in stmt.names:
                        checked[alias.asname or alias.name] = stmt.module or ""
    lazy = dict(ml._LAZY)
    defined_here = {"jit", "shard_map", "pjit", "pipeline", "__version__"}
    frontends = dict.fromkeys(
        ("jit", "shard_map", "pjit", "pipeline"), "meshlift.frontends"
    )  # the stub
    assert {k: v for k, v in checked.items() if k != "plugins"} == lazy | frontends
    assert set(ml.__all__) == set(lazy) | defined_here | {"plugins"}
    for name, module in lazy.items():
        assert getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
