"""`meshlift demo` trains, and the parameters end up sharded by its plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshlift import demo

# What demo.PLAN says, as JSON specs (a list entry per array dimension).
EXPECTED_SPECS = {
    "linear1.kernel": [None, "model"],
    "linear1.bias": ["model"],
    "linear2.kernel": ["model", None],
    "linear2.bias": [],
}


def _normalize(spec: list) -> list:
    """Trailing None entries mean the same as leaving them out."""
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def run_json(capsys, *argv: str) -> dict:
    assert demo.main(["--steps", "20", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mesh", [None, "data=4,model=2"])
def test_demo_trains_and_shards(capsys, mesh):
    result = run_json(capsys, *(["--mesh", mesh] if mesh else []))

    expected_mesh = {"data": 4, "model": 2} if mesh else {"data": 2, "model": 4}
    assert result["mesh"] == expected_mesh
    assert len(result["losses"]) == result["steps"] == 20
    assert result["final_loss"] < 0.75 * result["first_loss"]

    params = {row["path"]: row for row in result["params"]}
    assert set(params) == set(EXPECTED_SPECS)
    for path, spec in EXPECTED_SPECS.items():
        assert _normalize(params[path]["spec"]) == _normalize(spec), path
    # linear1.kernel is (64, 256) float32, split 'model' ways by columns.
    kernel = params["linear1.kernel"]
    assert kernel["shape"] == [64, 256] and kernel["dtype"] == "float32"
    assert kernel["bytes_per_device"] == 64 * 256 * 4 // expected_mesh["model"]


def test_demo_is_deterministic(capsys):
    first, second = run_json(capsys, "--seed", "3"), run_json(capsys, "--seed", "3")
    assert first["losses"] == second["losses"]


def test_demo_tables(capsys):
    assert demo.main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "final loss" in out
    assert "linear1.kernel" in out and "P(None, 'model')" in out


def test_demo_rejects_bad_mesh(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--mesh", "data=2"])
    assert exc.value.code == 2
    assert "data" in capsys.readouterr().err


def test_demo_too_few_devices_exits_nonzero():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "meshlift.demo", "--steps", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "needs 8 devices, but JAX has 2 cpu devices" in proc.stderr
