"""The ``meshlift`` command line, run in-process through ``main(argv)`` (and, where the
terminal matters, in a subprocess), and the packaging it reports on: LICENSE, metadata and
the package readmes.

In the ``site`` tests really installed plugins are disabled; they install fake
distributions (a ``*.dist-info`` folder plus a plugin module) into a temporary folder.
"""

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import types
from importlib.metadata import entry_points, files, metadata, version
from pathlib import Path

import pytest

import meshlift.tools
from meshlift import plugins
from meshlift.tools.cli import main


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on ``sys.path`` to install fake distributions into; no other plugins."""
    real = [ep.name for ep in entry_points(group="meshlift")]
    monkeypatch.setenv(plugins.DISABLE_ENV, ",".join(real))
    monkeypatch.delenv(plugins.STRICT_ENV, raising=False)
    monkeypatch.syspath_prepend(tmp_path)
    for module in ("toy_cli_plugin", "broken_cli_plugin"):  # an earlier test's, imported
        monkeypatch.delitem(sys.modules, module, raising=False)
    plugins.reset_registry()
    yield tmp_path
    plugins.reset_registry()


def install(site, dist, version, entry_point, source, license_lines=""):
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.4\nName: {dist}\nVersion: {version}\n{license_lines}"
    )
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
                                capabilities={"donation"}, description="A toy backend."))
    """
    install(site, "meshlift-toy", "2.5", "toy", source, "License-Expression: MIT\n")


@pytest.fixture
def broken(site):
    install(site, "meshlift-broken", "0.3", "broken", "import meshlift_no_such_module\n")


def test_backends_lists_plugins_from_metadata_without_importing_them(toy, broken, capsys):
    assert main(["backends"]) == 0  # a broken plugin is not imported, so it cannot fail here

    out = capsys.readouterr().out
    assert "toy" in out and "meshlift-toy" in out and "2.5" in out
    assert "broken" in out and "meshlift-broken" in out
    assert "meshlift backends --check" in out
    assert "toy_cli_plugin" not in sys.modules and "broken_cli_plugin" not in sys.modules


def test_backends_listing_leaves_out_disabled_plugins(toy, capsys, monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_ENV, os.environ[plugins.DISABLE_ENV] + ",toy")
    assert main(["backends"]) == 0

    out = capsys.readouterr().out
    assert "meshlift-toy" not in out
    assert "No backends installed" in out and f"Disabled by {plugins.DISABLE_ENV}: " in out
    assert "toy" in out.split(f"Disabled by {plugins.DISABLE_ENV}: ")[1].strip().split(", ")


def test_the_listing_reads_the_same_entry_point_group_as_the_registry():
    from meshlift.tools import cli

    assert (cli.ENTRY_POINT_GROUP, cli.DISABLE_ENV) == (
        plugins.ENTRY_POINT_GROUP,
        plugins.DISABLE_ENV,
    )


def test_backends_check_table(toy, capsys):
    assert main(["backends", "--check"]) == 0

    out = capsys.readouterr().out
    assert "name" in out and "capabilities" in out
    assert "toy" in out and "2.5" in out and "donation" in out and "A toy backend." in out
    assert "failed to load" not in out


def test_backends_check_shows_load_errors_below(toy, broken, capsys):
    assert main(["backends", "--check"]) == 1

    out = capsys.readouterr().out
    assert out.index("toy") < out.index("1 plugin(s) failed to load:")
    assert "broken (meshlift-broken 0.3): ModuleNotFoundError" in out
    assert "MESHLIFT_DISABLE_PLUGINS=<name>" in out


@pytest.mark.parametrize("argv", [["backends"], ["backends", "--check"]])
def test_backends_with_nothing_installed(site, capsys, argv):
    assert main(argv) == 0

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
            "capabilities": ["donation"],
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


def test_version_lists_each_distribution_with_its_license(toy, broken, capsys):
    assert main(["--version"]) == 0

    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    core_license = metadata("meshlift")["License-Expression"]
    assert rows[0] == ["meshlift", version("meshlift"), core_license, "core"]
    assert rows[1][:3] == ["meshlift-broken", "0.3", "license"]  # no license field: "unknown"
    assert rows[1][3:5] == ["unknown", "plugin"] and "failed to load" in " ".join(rows[1])
    assert rows[2] == ["meshlift-toy", "2.5", "MIT", "backend", "toy"]
    assert len(rows) == 3


@pytest.mark.parametrize(
    ("license_lines", "shown"),
    [
        ("License-Expression: BSD-3-Clause\nLicense: ignored\n", "BSD-3-Clause"),
        ("License: MIT\n", "MIT"),
        ("License: Apache Software License\n        the whole text...\n", "Apache"),
        ("Classifier: License :: OSI Approved :: MIT License\n", "MIT License"),
    ],
)
def test_version_reads_the_license_field_a_distribution_has(site, capsys, license_lines, shown):
    source = """
        import jax
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register(ml.Backend(name="lic", stage=lambda fn, spec: jax.jit(fn)))
    """
    install(site, "meshlift-lic", "1.0", "lic", source, license_lines)
    assert main(["--version"]) == 0

    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("meshlift-lic") and line.endswith("backend lic")
    assert shown in line and "ignored" not in line and "whole text" not in line


def test_the_core_is_installed_with_its_license_and_urls():
    """The metadata pyproject.toml declares is what an install carries (and --version reads)."""
    info = metadata("meshlift")
    assert info["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (info.get_all("License-File") or [])
    urls = dict(u.split(", ", 1) for u in info.get_all("Project-URL") or [])
    assert set(urls) == {"Documentation", "Source", "Issues"}
    assert "LICENSE" in {Path(f.name).name for f in files("meshlift") if "licenses" in str(f)}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "meshlift plan mymodels:make_mlp --mesh data=2,model=4"),
        (["backends"], "meshlift backends --json"),
        (["plan"], "meshlift plan mymodels:make_mlp --mesh data=2,model=4 --rules"),
        (["demo"], "meshlift demo --steps 60"),
    ],
)
def test_help_of_each_command_has_an_example(argv, expected, capsys, demo_env):
    assert main([*argv, "--help"]) == 0

    out = capsys.readouterr().out
    assert out.startswith(f"usage: meshlift {' '.join(argv)}".rstrip())
    assert expected in " ".join(out.split())  # argparse may wrap the example


def _examples(help_text: str) -> list[str]:
    """The example command lines of a --help: the lines under "examples:" that run meshlift."""
    tail = help_text.split("\nexamples:\n", 1)[1]
    return [line.strip() for line in tail.splitlines() if line.strip().startswith("meshlift")]


@pytest.mark.parametrize("command", [[], ["backends"], ["plan"], ["demo"]])
def test_help_shows_every_option_with_an_example(command, capsys, demo_env):
    """Each option a --help lists is used by one of the examples under it."""
    assert main([*command, "--help"]) == 0

    out = capsys.readouterr().out
    options = set(re.findall(r"^  (--[a-z-]+)", out, flags=re.M)) - {"--help"}
    assert options, out
    examples = _examples(out)
    for option in options:
        assert any(option in example.split() for example in examples), (option, examples)
    if command == ["plan"]:  # the positional argument too
        assert all("mymodels:make_mlp" in example for example in examples)
    if not command:  # and every command
        for name in ("backends", "plan", "demo"):
            assert any(example.split()[1:2] == [name] for example in examples), name


@pytest.fixture
def demo_env(monkeypatch):
    """Importing meshlift.tools.demo sets XLA_FLAGS and JAX_PLATFORMS: undo that afterwards."""
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_demo_help_shows_every_option_of_the_demo(flag, capsys, demo_env):
    assert main(["demo", flag]) == 0

    out = capsys.readouterr().out
    assert out.startswith("usage: meshlift demo")
    for option in (
        "--steps STEPS",
        "--mesh MESH",
        "--backends BACKENDS",
        "--seed SEED",
        "--sample N",
        "--json",
    ):
        assert option in out
    assert "default: data=2,model=4" in out


def test_top_level_help_points_to_the_demos_options(capsys):
    assert main(["--help"]) == 0

    assert "meshlift demo --help for its options" in " ".join(capsys.readouterr().out.split())


def test_no_command_prints_help(capsys):
    assert main([]) == 2

    assert "{backends,demo,plan}" in capsys.readouterr().out


def test_unknown_argument_is_a_usage_error(capsys):
    assert main(["backends", "--nope"]) == 2

    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_demo_passes_its_arguments_through(monkeypatch):
    """``meshlift demo`` hands everything after ``demo`` to ``meshlift.tools.demo.main``."""
    calls = []
    stand_in = types.ModuleType("meshlift.tools.demo")
    stand_in.main = lambda argv: calls.append(argv) or 3
    monkeypatch.setitem(sys.modules, "meshlift.tools.demo", stand_in)
    monkeypatch.setattr(meshlift.tools, "demo", stand_in, raising=False)

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

    def make_linen_mlp():
        dense = nn.Dense(32, kernel_init=ml.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")))
        return dense.init(jax.random.key(0), jnp.ones((2, 16)))
"""


@pytest.fixture
def plan_models(tmp_path, monkeypatch):
    (tmp_path / "plan_models_cli.py").write_text(textwrap.dedent(PLAN_MODELS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "plan_models_cli", raising=False)
    return tmp_path


def test_plan_lists_the_non_divisible_parameter(plan_models, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # 80 columns fold the spec at its space
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


@pytest.mark.parametrize("as_json", [False, True])
def test_plan_without_rules_hints_at_a_rules_file_of_the_models_own_names(
    plan_models, capsys, as_json
):
    argv = ["plan", "plan_models_cli:make_linen_mlp", "--mesh", "data=2,model=4"]
    assert main(argv + ["--json"] * as_json) == 1
    captured = capsys.readouterr()
    out, err = " ".join(captured.out.split()), " ".join(captured.err.split())
    # the command line's advice, not Python's, and no name the model lacks
    for text in (out, err):
        assert "ml.axis_rules" not in text and "hidden" not in text
    assert "it has the logical names ('embed', 'mlp') but no --rules map them to mesh axes" in out
    assert err.startswith("hint: pass --rules FILE")
    assert '[["embed", null], ["mlp", null]]' in err and "(data or model)" in err


def test_plan_reports_a_rule_naming_an_axis_the_mesh_lacks(plan_models, capsys):
    (plan_models / "rules.json").write_text('[["hidden", "modle"], ["embed", "data"]]')
    argv = ["plan", "plan_models_cli:make_linen", "--mesh", "data=2,model=4"]
    assert main([*argv, "--rules", "rules.json"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the table wraps long problems
    assert (
        "params.kernel: axis rule ('hidden', 'modle') names the mesh axis 'modle' (did you "
        "mean 'model'?), which the mesh {'data': 2, 'model': 4} lacks, so the rule is skipped; "
        "it is less sharded than the rule asks" in out
    )


def test_plan_bad_arguments(plan_models, capsys):
    assert main(["plan", "plan_models_cli", "--mesh", "data=2"]) == 2
    assert main(["plan", "plan_models_cli:make_nnx", "--mesh", "data2"]) == 2
    assert "MODULE:FACTORY" in capsys.readouterr().err


# -- --show: a picture of the blocks of a parameter over the devices ------------------------
def test_plan_show_draws_the_blocks_with_their_device_ids(plan_models, capsys):
    argv = ["plan", "plan_models_cli:make_linen", "--mesh", "data=2,model=4"]
    (plan_models / "rules.json").write_text('[["hidden", "model"], ["embed", "data"]]')
    assert main([*argv, "--rules", "rules.json", "--show", "params.kernel"]) == 0

    out = capsys.readouterr().out
    picture = out[out.index("params.kernel (16, 32) float32") :]
    cells = [line.split("│")[1:-1] for line in picture.splitlines() if "CPU" in line]
    # data splits the rows, model the columns: device d holds block (d // 4, d % 4)
    assert [[c.strip() for c in row] for row in cells] == [
        ["CPU 0", "CPU 1", "CPU 2", "CPU 3"],
        ["CPU 4", "CPU 5", "CPU 6", "CPU 7"],
    ]
    assert "8 blocks of (8, 8), each on 1 device(s)" in picture


def test_plan_show_json_has_every_block_and_its_devices(plan_models, capsys):
    argv = ["plan", "plan_models_cli:make_nnx", "--mesh", "data=2,model=2", "--json"]
    assert main([*argv, "--show", "kernel", "--show", "bias"]) == 0

    layouts = {layout["path"]: layout for layout in json.loads(capsys.readouterr().out)["layouts"]}
    assert layouts["kernel"]["spec"] == [None, "model"]
    assert [(b["index"], b["devices"]) for b in layouts["kernel"]["blocks"]] == [
        ([[0, 16], [0, 15]], [0, 2]),
        ([[0, 16], [15, 30]], [1, 3]),
    ]
    assert layouts["bias"]["blocks"] == [{"index": [[0, 30]], "devices": [0, 1, 2, 3]}]


@pytest.mark.parametrize(
    ("show", "error", "hint"),
    [
        ("kernl", "no parameter 'kernl' on this plan; did you mean kernel?", "--show bias"),
        ("linear.kernel", "did you mean kernel?", "the table's first column"),
    ],
)
def test_plan_show_unknown_path_is_one_line_with_near_matches(
    plan_models, capsys, show, error, hint
):
    argv = ["plan", "plan_models_cli:make_nnx", "--mesh", "data=2,model=2", "--show", show]
    assert main(argv) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 2 and error in lines[0] and hint in lines[1], lines


def test_plan_show_of_a_spec_that_does_not_fit_says_why(plan_models, capsys):
    argv = ["plan", "plan_models_cli:make_nnx", "--mesh", "data=2,model=4", "--show", "kernel"]
    assert main(argv) == 2  # 30 columns over 4 devices

    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("error: --show 'kernel': cannot draw `kernel`: dimension 1")
    assert "without --show" in lines[1]


def test_plan_show_in_a_fresh_process_simulates_the_devices_in_80_columns(plan_models):
    """No XLA_FLAGS: meshlift asks for as many CPU devices as the mesh has; no "…"."""
    (plan_models / "deep_cli.py").write_text(textwrap.dedent(DEEP_MODEL))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from meshlift.tools.cli import main; raise SystemExit(main())",
            "plan",
            "deep_cli:make_deep",
            "--mesh",
            "data=2,model=8",
            "--show",
            DEEP_PATH,
        ],
        cwd=plan_models,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "80", "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout
    assert max(len(line) for line in run.stdout.splitlines()) <= 80
    picture = run.stdout[run.stdout.index(f"{DEEP_PATH} (64, 256)") :]
    assert "CPU 7,15" in picture and "8 blocks of (64, 32), each on 2 device(s)" in picture


# -- a user's mistakes: `error: ...` and `hint: ...` on stderr, status 2, no traceback ------
USER_MODELS = """
    from flax import nnx

    class GPT(nnx.Module):
        def __init__(self, rngs, width=8):
            self.linear = nnx.Linear(width, width, rngs=rngs)

    def make_broken():
        raise ValueError("vocab_size must be set")

    def make_nothing():
        return {}

    NOT_CALLABLE = 3
"""


@pytest.fixture
def user_models(plan_models):
    (plan_models / "user_models_cli.py").write_text(textwrap.dedent(USER_MODELS))
    (plan_models / "syntax_error_cli.py").write_text("def f(:\n")
    (plan_models / "needs_dep_cli.py").write_text("import meshlift_no_such_dependency\n")
    (plan_models / "bad_rules.json").write_text('{"hidden": "model"}')
    (plan_models / "not_json.json").write_text("[[hidden, model]]")
    (plan_models / "bad_pair.json").write_text('[["batch", "data"], ["hidden"]]')
    for name in ("user_models_cli", "syntax_error_cli", "needs_dep_cli"):
        sys.modules.pop(name, None)
    return plan_models


MESH = ["--mesh", "data=2,model=4"]


@pytest.mark.parametrize(
    ("argv", "error", "hint"),
    [
        (
            ["user_models_cli:GPT", *MESH],
            "GPT needs arguments (rngs)",
            "def make_model(): return GPT(rngs=nnx.Rngs(0))",
        ),
        (
            ["user_models_cli:make_broken", *MESH],
            "ValueError: vocab_size must be set (at ",
            "python -c 'import user_models_cli as m; m.make_broken()'",
        ),
        (
            ["user_models_cli:make_nothing", *MESH],
            "returned no arrays (a dict)",
            "return an NNX module",
        ),
        (
            ["user_models_cli:NOT_CALLABLE", *MESH],
            "is not callable: it is the int 3",
            "zero-argument",
        ),
        (
            ["user_models_cli:GTP", *MESH],
            "'user_models_cli' has no attribute 'GTP'",
            "it has: GPT, make_broken",
        ),
        (
            ["no_such_module_cli:make", *MESH],
            "no module named 'no_such_module_cli'",
            "the folder that holds no_such_module_cli.py",
        ),
        (
            ["syntax_error_cli:f", *MESH],
            "SyntaxError: invalid syntax (at ",
            "python -c 'import syntax_error_cli'",
        ),
        (
            ["needs_dep_cli:f", *MESH],
            "No module named 'meshlift_no_such_dependency'",
            "install what it imports",
        ),
        (["user_models_cli", *MESH], "is not MODULE:FACTORY", "mypkg.models:make_model"),
        (
            ["user_models_cli:GPT", "--mesh", "data2"],
            "'data2' is not NAME=SIZE",
            "--mesh data=2,model=4",
        ),
        (
            ["user_models_cli:GPT", "--mesh", "data=2,model=x"],
            "the size of 'model' is not a positive integer",
            "--mesh data=2,model=4",
        ),
        (
            ["user_models_cli:GPT", "--mesh", "data=0"],
            "the size of 'data' is not a positive",
            "--mesh data=2,model=4",
        ),
        (
            ["user_models_cli:GPT", "--mesh", "data=2,data=4"],
            "the axis 'data' is given twice",
            "--mesh data=2,model=4",
        ),
        (
            ["user_models_cli:GPT", *MESH, "--rules", "missing.json"],
            "No such file or directory",
            "JSON list of [logical_name, mesh_axis or null] pairs",
        ),
        (["user_models_cli:GPT", *MESH, "--rules", "not_json.json"], "is not JSON", "JSON list"),
        (
            ["user_models_cli:GPT", *MESH, "--rules", "bad_rules.json"],
            "holds a dict, not a list",
            "JSON list",
        ),
        (
            ["user_models_cli:GPT", *MESH, "--rules", "bad_pair.json"],
            '["hidden"] is not such a pair',
            "JSON list",
        ),
    ],
    ids=[
        "class-needs-arguments",
        "factory-raises",
        "no-arrays",
        "not-callable",
        "no-such-attribute",
        "no-such-module",
        "syntax-error",
        "missing-dependency",
        "no-colon",
        "mesh-no-equals",
        "mesh-size-not-a-number",
        "mesh-size-zero",
        "mesh-axis-twice",
        "rules-file-missing",
        "rules-not-json",
        "rules-not-a-list",
        "rules-bad-pair",
    ],
)
def test_plan_mistakes_are_one_error_line_and_a_hint(user_models, capsys, argv, error, hint):
    assert main(["plan", *argv]) == 2

    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2, captured.err
    assert lines[0].startswith("error: ") and error in lines[0]
    assert lines[1].startswith("hint: ") and hint in lines[1]
    assert "Traceback" not in captured.err and captured.out == ""


def test_plan_mistake_in_a_subprocess_prints_no_traceback(user_models):
    """What a user sees from the shell: two lines on stderr, status 2."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from meshlift.tools.cli import main; raise SystemExit(main())",
            "plan",
            "user_models_cli:GPT",
            *MESH,
        ],
        cwd=user_models,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines()[-2:] == [
        "error: user_models_cli:GPT needs arguments (rngs), and meshlift plan calls it with none",
        "hint: name a zero-argument factory, e.g. in user_models_cli.py: def make_model(): "
        "return GPT(rngs=nnx.Rngs(0)); then meshlift plan user_models_cli:make_model",
    ]
    assert "Traceback" not in run.stderr


def test_plan_accepts_a_class_whose_arguments_all_have_defaults(plan_models, capsys):
    (plan_models / "defaults_cli.py").write_text(
        textwrap.dedent("""
        from flax import nnx

        class Small(nnx.Module):
            def __init__(self, rngs=None, width=8):
                self.linear = nnx.Linear(width, width, rngs=rngs or nnx.Rngs(0))
    """)
    )
    sys.modules.pop("defaults_cli", None)
    assert main(["plan", "defaults_cli:Small", *MESH, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {row["path"] for row in rows} == {"linear.bias", "linear.kernel"}


# -- narrow terminals: tables fold long cells instead of cutting them with "…" ----------------
DEEP_MODEL = """
    from flax import nnx
    import meshlift as ml

    class Attention(nnx.Module):
        def __init__(self, rngs):
            init = ml.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.query_projection_with_a_long_name = nnx.Linear(64, 256, kernel_init=init,
                                                                rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.self_attention_layer = Attention(rngs)

    def make_deep():
        return nnx.List([Block(nnx.Rngs(0)) for _ in range(2)])
"""
DEEP_PATH = "0.self_attention_layer.query_projection_with_a_long_name.kernel"


def _column(out: str, index: int) -> str:
    """The text of one column of a rich table's body, its folded lines joined, no spaces."""
    rows = [line.split("│") for line in out.splitlines() if line.count("│") > 2]
    return "".join(row[index + 1] for row in rows).replace(" ", "")


def test_plan_table_piped_into_80_columns_wraps(plan_models):
    (plan_models / "deep_cli.py").write_text(textwrap.dedent(DEEP_MODEL))
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from meshlift.tools.cli import main; raise SystemExit(main())",
            "plan",
            "deep_cli:make_deep",
            *MESH,
        ],
        cwd=plan_models,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},  # stdout is a pipe, not a terminal
    )
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout
    assert max(len(line) for line in run.stdout.splitlines()) <= 80
    assert DEEP_PATH in _column(run.stdout, 0), run.stdout  # every character of the path is shown


def test_backends_table_in_80_columns_wraps(site, monkeypatch, capsys):
    source = """
        import jax
        import meshlift as ml

        @ml.hookimpl
        def meshlift_register_backends(register):
            register(ml.Backend(
                name="a_backend_with_a_rather_long_name", stage=lambda fn, spec: jax.jit(fn),
                capabilities={"auto-partitioning", "manual-collectives", "call-site-mesh"},
                description="A backend whose description goes on for a while, to wrap it."))
    """
    install(site, "meshlift-a-distribution-with-a-long-name", "10.20.30", "longish", source)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["backends"]) == 0  # from the metadata

    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert _column(out, 1) == "meshlift-a-distribution-with-a-long-name"

    assert main(["backends", "--check"]) == 0  # imported

    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert _column(out, 0) == "a_backend_with_a_rather_long_name"
    assert _column(out, 1) == "meshlift-a-distribution-with-a-long-name"
    assert _column(out, 3) == "auto-partitioning,call-site-mesh,manual-collectives"
    assert _column(out, 4) == "Abackendwhosedescriptiongoesonforawhile,towrapit."


# -- ready to publish: LICENSE, metadata and a readme in every distribution --------------------
ROOT = Path(__file__).resolve().parents[3]
DISTRIBUTIONS = [
    "packages/meshlift",
    "plugins/meshlift-jit",
    "plugins/meshlift-shard-map",
    "plugins/meshlift-pjit",
    "plugins/meshlift-pipeline",
    "docs/examples/meshlift-remat",
]


def test_one_apache_license_at_the_root_and_in_every_distribution():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    for folder in DISTRIBUTIONS:
        assert (ROOT / folder / "LICENSE").read_text() == text, folder


@pytest.mark.parametrize("folder", DISTRIBUTIONS)
def test_pyproject_metadata_is_ready_to_publish(folder):
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert project["authors"] == [{"name": "meshlift developers"}]
    classifiers = set(project["classifiers"])
    for minor in (11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert {
        "Operating System :: OS Independent",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    } <= classifiers
    # PEP 639: the SPDX `license` replaces license classifiers; PyPI refuses both together.
    assert not [c for c in classifiers if c.startswith("License ::")]
    urls = project["urls"]
    assert set(urls) == {"Documentation", "Source", "Issues"}
    assert all(u.startswith("https://github.com/meshlift/meshlift/") for u in urls.values())
    assert urls["Source"].endswith(f"/tree/main/{folder}")


@pytest.mark.parametrize("folder", DISTRIBUTIONS)
def test_package_readme_says_what_it_is_how_to_install_and_shows_an_example(folder):
    readme = (ROOT / folder / "README.md").read_text()
    name = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]["name"]
    assert readme.startswith(f"# {name}")
    assert [line for line in readme.splitlines() if "pip install" in line and folder in line]
    assert "```python\n" in readme
    assert "See the repository README." not in readme


README_BLOCKS = {
    folder: re.findall(
        r"^```python\n(.*?)^```", (ROOT / folder / "README.md").read_text(), flags=re.S | re.M
    )
    for folder in DISTRIBUTIONS[:5]  # the example backend runs its own README in its tests
    if (ROOT / folder / "README.md").exists()
}


@pytest.mark.parametrize("folder", DISTRIBUTIONS[:4])
def test_package_readme_example_runs(folder):
    needed = {
        "plugins/meshlift-jit": "jit",
        "plugins/meshlift-shard-map": "shard_map",
        "plugins/meshlift-pjit": "pjit",
        "packages/meshlift": "jit",
    }[folder]
    plugins.reset_registry()
    assert needed in {b.name for b in meshlift.backends()}, f"install the {needed} backend"
    assert README_BLOCKS.get(folder)
    namespace: dict = {"__name__": f"__readme_{folder.replace('/', '_')}__"}
    for i, block in enumerate(README_BLOCKS[folder]):
        exec(compile(block, f"{folder}/README.md:block{i}", "exec"), namespace)
