"""`meshlift demo`: every installed backend trains the transformer to the same parameters."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

import meshlift as ml
from meshlift.tools import demo, demo_display

STEPS = "8"


def _normalize(spec: list | None) -> list:
    """Trailing None entries mean the same as leaving them out."""
    spec = list(spec or [])
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def run_json(capsys, *argv: str) -> dict:
    assert demo.main(["--steps", STEPS, "--json", "--sample", "0", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def result() -> dict:
    """One default run (all backends, mesh data=2,model=4), shared by the checks below."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert demo.main(["--steps", STEPS, "--json", "--seed", "3"]) == 0
    return json.loads(out.getvalue())


def test_every_installed_backend_ran(result):
    ran = [r["backend"] for r in result["backends"]]
    assert sorted(ran) == sorted(b.name for b in ml.backends())
    assert ran[0] == result["reference"] == "jit"
    assert result["mesh"] == {"data": 2, "model": 4}


def test_loss_decreased(result):
    for r in result["backends"]:
        assert len(r["losses"]) == int(STEPS)
        assert r["final_loss"] < 0.85 * r["first_loss"], r["backend"]


def test_backends_agree_with_jit(result):
    assert result["agree"]
    for r in result["backends"]:
        assert r["max_abs_diff"] <= 1e-5, r["backend"]
        assert r["final_loss"] == pytest.approx(result["backends"][0]["final_loss"], abs=1e-5)


def test_parameters_are_sharded_by_the_plan(result):
    planned = {row["path"]: _normalize(row["spec"]) for row in result["plan"]["rows"]}
    assert planned["blocks.0.attention.query.kernel"] == [None, "model"]
    assert planned["blocks.0.down.kernel"] == ["model"]
    assert planned["embed.embedding"] == ["model"]
    for r in result["backends"]:
        params = {row["path"]: row for row in r["params"]}
        assert set(params) == set(planned), r["backend"]
        assert all(row["matches_plan"] for row in r["params"]), r["backend"]
        for path, spec in planned.items():  # one plan under every backend, shard_map included
            assert _normalize(params[path]["spec"]) == spec, (r["backend"], path)
        assert r["param_bytes_per_device"] == result["plan"]["bytes_per_device"], r["backend"]


def test_the_trained_model_writes_a_sample(result):
    sample = result["sample"]
    assert sample["backend"] == "jit" and sample["decoding"] == "greedy"
    assert sample["prompt"] == demo.PROMPT and len(sample["prompt"]) == demo.SEQ
    assert len(sample["text"]) == demo.SAMPLE
    assert all(ord(c) < demo.VOCAB for c in sample["text"])


def test_no_sample_with_sample_zero(capsys):
    assert run_json(capsys, "--backends", "jit")["sample"] is None


def test_demo_is_deterministic(capsys, result):
    again = run_json(capsys, "--seed", "3", "--backends", "jit")
    assert again["backends"][0]["losses"] == result["backends"][0]["losses"]
    other = run_json(capsys, "--seed", "4", "--backends", "jit")
    assert other["backends"][0]["losses"] != result["backends"][0]["losses"]


def test_demo_exits_nonzero_when_backends_disagree(capsys, monkeypatch):
    monkeypatch.setattr(demo, "TOLERANCE", -1.0)  # nothing can agree to a negative tolerance
    assert demo.main(["--steps", "1", "--json", "--backends", "jit", "--sample", "0"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["agree"] is False
    assert "the backends do not agree" in captured.err


def test_demo_tables(monkeypatch):
    # Piped: a header first, then a plain line per backend as it finishes (each already
    # written when the next backend starts training), then the tables.
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    written_at_start = []
    real_train = demo.train

    def train(backend, *args):
        written_at_start.append(out.getvalue())
        return real_train(backend, *args)

    monkeypatch.setattr(demo, "train", train)
    assert demo.main(["--steps", "2", "--mesh", "data=4,model=2", "--sample", "12"]) == 0
    out = out.getvalue()
    order = demo._default_backends()  # jit first
    assert written_at_start[0].startswith("meshlift demo: 2 training steps of a character")
    for i, done in enumerate(order[:-1]):
        assert f"{done}: 2 steps, loss " in written_at_start[i + 1], written_at_start
    assert out.index(f"{order[-1]}: 2 steps, loss ") < out.index("Δparameter")
    assert "nan" not in out
    for name in order:
        assert name in out
    words = " ".join(out.split())
    # one sentence for however many backends agree; the loss says what it is
    assert "pjit and shard_map agree with jit to 1e-05" in out and "all 3" not in out
    assert "(cross-entropy," in out and "nats)" in out  # the column header, folded
    # the plan's table is what every backend ran, shard_map included, in the same units
    assert "replicate every parameter" not in out
    assert "every backend's parameters above follow it" in words
    total = re.search(r"total per device: ([0-9.]+ [KM]?i?B) of", out)
    assert total, out
    jit_row = next(line for line in out.splitlines() if line.startswith("│ jit "))
    assert jit_row.split("│")[-2].strip() == total.group(1), jit_row
    assert "blocks.0.up.kernel" in out and "P(None, 'model')" in out  # the explain table
    # last, the sample: the prompt and the 12 characters the model wrote after it
    intro = f"the jit backend's model writes, after the prompt {demo.PROMPT!r}"
    assert intro in out and "(greedy decoding, 12 characters)" in out
    line = out[out.index(intro) :].split("\n")[1]  # prompt + what the model wrote, one line
    assert line.startswith(demo.PROMPT) and len(line) == len(demo.PROMPT) + 12, repr(line)


def test_demo_tables_fold_in_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert demo.main(["--steps", "1", "--backends", "jit", "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    # one backend agrees with nothing: the summary says so rather than "all 1 backends"
    assert "jit is the only backend that ran" in " ".join(out.split())
    assert "backends agree" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh", "data=2"],
        ["--mesh", "data=3,model=4"],
        ["--mesh", "rows=2,model=4"],
        ["--backends", "no-such-backend"],
        ["--steps", "0"],
        ["--sample", "-1"],
    ],
)
def test_demo_rejects_bad_arguments(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert "meshlift demo: error" in capsys.readouterr().err


def test_demo_too_few_devices_exits_nonzero():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "meshlift.tools.demo", "--steps", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "needs 8 devices, but JAX has 2 cpu device(s)" in proc.stderr


def test_progress_bar_says_compiling_until_the_first_step_returns():
    """Not "0/20 loss nan": to a JAX user nan means divergence."""
    from rich.console import Console

    bars = demo_display.Bars(Console(file=io.StringIO(), force_terminal=True, width=100))

    def shown() -> str:
        console = Console(file=io.StringIO(), width=100)
        console.print(bars.bars.get_renderable())
        return console.file.getvalue()

    bars.start("jit", 20)
    assert "compiling…" in shown() and "0/20" in shown() and "nan" not in shown()
    bars.step(2.5)
    assert "loss 2.5000" in shown() and "1/20" in shown() and "compiling" not in shown()


def test_demo_raises_the_simulated_device_count_to_the_mesh():
    """As `meshlift plan` does: no XLA_FLAGS set, a 16-device mesh gets 16 devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    argv = ["demo", "--mesh", "data=4,model=4", "--steps", "1", "--backends", "jit"]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from meshlift.tools.cli import main; sys.exit(main(sys.argv[1:]))",
            *argv,
            "--sample",
            "0",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["mesh"] == {"data": 4, "model": 4} and result["agree"]


def test_too_few_devices_blames_what_set_the_count(monkeypatch):
    needed = {"data": 4, "model": 4}
    monkeypatch.setattr(demo, "_USER_DEVICE_COUNT", False)  # the demo chose the count
    message = demo._too_few_devices(needed, 16, 8)
    assert "already created its devices" in message and "ask for 16" in message
    assert "XLA_FLAGS (" not in message  # no flag the user never set is blamed
    monkeypatch.setattr(demo, "_USER_DEVICE_COUNT", True)
    message = demo._too_few_devices(needed, 16, 8)
    assert "sets the count, and the demo leaves a count you set alone" in message
