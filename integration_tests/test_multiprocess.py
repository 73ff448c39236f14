"""Two real jax.distributed processes (4 CPU devices each) on 127.0.0.1: a 2x4 mesh across both.

Each installed backend trains the MLP case with process-local batches made
global by ``jax.make_array_from_process_local_data``; the losses and
parameters equal the single-process reference.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cases import MLP_CASE, installed_backends, is_manual, reference

import meshlift as ml

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(backend: str, tmp_path: Path) -> dict:
    port, out = free_port(), tmp_path / "result.json"
    env = {
        k: v for k, v in os.environ.items() if k != "XLA_FLAGS"
    }  # 4 devices each, set in the worker
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), backend, str(out)],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for i, log in enumerate(logs)
    ]
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:  # always reaped, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        tails = "\n".join(
            f"--- process {i} ---\n{log.read_text()[-3000:]}" for i, log in enumerate(logs)
        )
        pytest.fail(f"{backend}: the two processes exited with {codes}\n{tails}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", installed_backends())
def test_two_processes_match_one(backend, tmp_path):
    result = run_two_processes(backend, tmp_path)
    ref_losses, ref_params = reference(MLP_CASE)
    np.testing.assert_allclose(result["losses"], ref_losses, atol=1e-5)
    for (path, value), ref in zip(sorted(result["params"].items()), ref_params, strict=True):
        np.testing.assert_allclose(
            np.asarray(value), ref, atol=1e-5, err_msg=f"{backend}: `{path}`"
        )
    expected = "P()" if is_manual(ml.get_backend(backend)) else "P(None, 'model')"
    assert result["specs"]["linear1.kernel"] == expected
