"""The ``meshlift`` command line, run in-process through ``main(argv)``.

Really installed plugins are disabled; the tests install fake distributions
(a ``*.dist-info`` folder plus a plugin module) into a temporary folder.
"""

import importlib
import json
import sys
import textwrap
import types
from importlib.metadata import entry_points, version

import pytest

import meshlift
from meshlift import plugins
from meshlift.cli import main


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on ``sys.path`` to install fake distributions into; no other plugins."""
    real = [ep.name for ep in entry_points(group="meshlift")]
    monkeypatch.setenv(plugins.DISABLE_ENV, ",".join(real))
    monkeypatch.delenv(plugins.STRICT_ENV, raising=False)
    monkeypatch.syspath_prepend(tmp_path)
    plugins.reset_registry()
    yield tmp_path
    plugins.reset_registry()


def install(site, dist, version, entry_point, source):
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[meshlift]\n{entry_point} = {entry_point}_cli_plugin\n"
    )
    (site / f"{entry_point}_cli_plugin.py").write_text(textwrap.dedent(source))
    importlib.invalidate_caches()


@pytest.fixture
def toy(site):
    source = """
        import jax
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register(ml.Backend(name="toy", stage=lambda fn, spec: jax.jit(fn),
                                capabilities={"donate"}, description="A toy backend."))
    """
    install(site, "meshlift-toy", "2.5", "toy", source)


@pytest.fixture
def broken(site):
    install(site, "meshlift-broken", "0.3", "broken", "import meshlift_no_such_module\n")


def test_backends_table(toy, capsys):
    assert main(["backends"]) == 0

    out = capsys.readouterr().out
    assert "name" in out and "capabilities" in out
    assert "toy" in out and "2.5" in out and "donate" in out and "A toy backend." in out
    assert "failed to load" not in out


def test_backends_table_shows_load_errors_below(toy, broken, capsys):
    assert main(["backends"]) == 1

    out = capsys.readouterr().out
    assert out.index("toy") < out.index("1 plugin(s) failed to load:")
    assert "broken (meshlift-broken 0.3): ModuleNotFoundError" in out
    assert "MESHLIFT_DISABLE_PLUGINS=<name>" in out


def test_backends_with_nothing_installed(site, capsys):
    assert main(["backends"]) == 0

    assert "No backends installed. Try: pip install meshlift-jit" in capsys.readouterr().out


def test_backends_json(toy, broken, capsys):
    assert main(["backends", "--json"]) == 1

    data = json.loads(capsys.readouterr().out)
    assert data["meshlift"] == version("meshlift")
    assert data["backends"] == [
        {
            "name": "toy",
            "distribution": "meshlift-toy",
            "version": "2.5",
            "capabilities": ["donate"],
            "description": "A toy backend.",
        }
    ]
    assert data["errors"] == [
        {
            "plugin": "broken",
            "distribution": "meshlift-broken",
            "version": "0.3",
            "error": "ModuleNotFoundError: No module named 'meshlift_no_such_module'",
        }
    ]


def test_version(toy, capsys):
    assert main(["--version"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"meshlift {version('meshlift')}", "  toy: meshlift-toy 2.5"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "example: meshlift backends"),
        (["backends"], "meshlift backends --json"),
        (["demo"], "meshlift demo -- --help"),
    ],
)
def test_help_of_each_command_has_an_example(argv, expected, capsys):
    assert main([*argv, "--help"]) == 0

    out = capsys.readouterr().out
    assert out.startswith(f"usage: meshlift {' '.join(argv)}".rstrip())
    assert expected in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2

    assert "{backends,demo,plan}" in capsys.readouterr().out


def test_unknown_argument_is_a_usage_error(capsys):
    assert main(["backends", "--nope"]) == 2

    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_demo_passes_its_arguments_through(monkeypatch):
    """``meshlift demo`` hands everything after ``demo`` to ``meshlift.demo.main``."""
    calls = []
    stand_in = types.ModuleType("meshlift.demo")
    stand_in.main = lambda argv: calls.append(argv) or 3
    monkeypatch.setitem(sys.modules, "meshlift.demo", stand_in)
    monkeypatch.setattr(meshlift, "demo", stand_in, raising=False)

    assert main(["demo", "--steps", "3", "-v"]) == 3
    assert main(["demo", "--", "--help"]) == 3
    assert calls == [["--steps", "3", "-v"], ["--help"]]


PLAN_MODELS = """
    import jax, jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import meshlift as ml

    def make_nnx():
        init = nnx.initializers.lecun_normal()
        return nnx.Linear(16, 30, kernel_init=ml.with_partitioning(init, (None, "model")),
                          rngs=nnx.Rngs(0))

    def make_linen():
        dense = nn.Dense(32, kernel_init=ml.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "hidden")))
        return dense.init(jax.random.key(0), jnp.ones((2, 16)))
"""


@pytest.fixture
def plan_models(tmp_path, monkeypatch):
    (tmp_path / "plan_models_cli.py").write_text(textwrap.dedent(PLAN_MODELS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "plan_models_cli", raising=False)
    return tmp_path


def test_plan_lists_the_non_divisible_parameter(plan_models, capsys):
    assert main(["plan", "plan_models_cli:make_nnx", "--mesh", "data=2,model=4"]) == 1
    out = capsys.readouterr().out
    assert "kernel" in out and "P(None, 'model')" in out and "not divisible by 4" in out


def test_plan_with_rules_file_and_json(plan_models, capsys):
    (plan_models / "rules.json").write_text('[["hidden", "model"], ["batch", "data"]]')
    argv = [
        "plan",
        "plan_models_cli:make_linen",
        "--mesh",
        "data=2,model=4",
        "--rules",
        "rules.json",
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    specs = {row["path"]: row["spec"] for row in data["rows"]}
    assert specs == {"params.bias": [], "params.kernel": [None, "model"]}
    assert data["problems"] == []


def test_plan_bad_arguments(plan_models, capsys):
    assert main(["plan", "plan_models_cli", "--mesh", "data=2"]) == 2
    assert main(["plan", "plan_models_cli:make_nnx", "--mesh", "data2"]) == 2
    assert "MODULE:FACTORY" in capsys.readouterr().err
