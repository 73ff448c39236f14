"""meshlift's conformance kit: a pytest plugin, opt-in, that checks a backend end to end.

Not loaded into every pytest run (there is no `pytest11` entry point). Opt in
from the test module that runs the suite (or a root `conftest.py`, or
`-p meshlift.testing` on the command line):

```python
# tests/test_conformance.py of a backend distribution
from meshlift.testing import TestConformance  # noqa: F401  (the suite, collected here)

pytest_plugins = ["meshlift.testing"]
meshlift_backends = ["my-backend"]      # this module tests only this backend
```

Against every installed backend (or those named with `--meshlift-backend`):

```sh
pytest -p meshlift.testing --pyargs meshlift.testing.suite [--meshlift-backend NAME]
```

What the plugin adds:

* `meshlift_backend`: a fixture parametrized over backends, giving the
  `ml.Backend`. Which backends: a `meshlift_backends` list (names or
  `ml.Backend` objects) on the test class, else on the test module; else
  those named by `--meshlift-backend NAME` (repeatable); else every
  installed backend.
* `@requires("stages", ...)` (from this module): the test needs these
  capabilities; a backend that lacks one is expected to fail it (a strict
  xfail, with the reason), never skipped.
* `meshlift_mesh`: a `{"data": 2, "model": 4}` mesh of 8 devices.
  Importing this module sets `XLA_FLAGS` to 8 simulated CPU devices unless
  `XLA_FLAGS` is already set.
* `meshlift_per_shard`: whether the backend runs the function once per shard
  (capability `manual-collectives`), so tests pick the step that writes its
  collectives out (see `meshlift.testing.models`).
* `meshlift_train_step`: the kit's train step in the form the backend's
  capabilities call for: global, per shard, or per shard averaging its own
  gradients (no `vma-gradients`: pmap's semantics).
* `TestConformance`: the suite (`meshlift.testing.suite`).

(PYTEST_DONT_REWRITE: this module asserts nothing; the suite's asserts are rewritten.)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any

import jax
import pytest

# Rewrite the suite's asserts, even when a test module imports it before registering this plugin.
pytest.register_assert_rewrite("meshlift.testing.suite", "meshlift.testing.models")

import meshlift as ml  # noqa: E402
from meshlift.testing import models  # noqa: E402
from meshlift.testing.capabilities import (  # noqa: E402
    MANUAL,
    VMA_GRADIENTS,
    missing,
    required_by,
    requires,
)
from meshlift.testing.suite import TestConformance  # noqa: E402

__all__ = [
    "MANUAL",
    "TestConformance",
    "missing",
    "pytest_addoption",
    "pytest_generate_tests",
    "requires",
]

MESH_SHAPE = {"data": 2, "model": 4}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshlift", "meshlift conformance kit")
    group.addoption(
        "--meshlift-backend",
        action="append",
        default=None,
        metavar="NAME",
        help="run meshlift's conformance tests against this installed backend only "
        "(repeatable; default: every installed backend). A test module's or class's "
        "meshlift_backends list wins.",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "meshlift_backend" not in metafunc.fixturenames:
        return
    backends = [ml.get_backend(b) for b in _selected(metafunc)]
    required = required_by(metafunc.function)
    params = []
    for backend in backends:
        lacks = missing(backend, required)
        marks = []
        if lacks:
            reason = (
                f"backend {backend.name!r} lacks capabilities {sorted(lacks)}, which this test "
                f"needs, so it must fail; if it passes, add them to the backend's capabilities"
            )
            marks.append(pytest.mark.xfail(reason=reason, strict=True))
        params.append(pytest.param(backend, marks=marks, id=backend.name))
    metafunc.parametrize("meshlift_backend", params, indirect=True)


def _selected(metafunc: pytest.Metafunc) -> list[str | ml.Backend]:
    for owner in (metafunc.cls, metafunc.module):
        chosen = getattr(owner, "meshlift_backends", None)
        if chosen is not None:
            if isinstance(chosen, str | ml.Backend):
                chosen = [chosen]
            return list(chosen)
    named = metafunc.config.getoption("meshlift_backend", default=None)
    if named:
        return list(named)
    return sorted(b.name for b in ml.backends())


@pytest.fixture
def meshlift_backend(request: pytest.FixtureRequest) -> ml.Backend:
    """The backend under test (parametrized by the plugin; see the module docstring)."""
    return request.param


@pytest.fixture
def meshlift_per_shard(meshlift_backend: ml.Backend) -> bool:
    """True when the backend runs the function once per shard, with explicit collectives."""
    return MANUAL in meshlift_backend.capabilities


@pytest.fixture
def meshlift_train_step(meshlift_backend: ml.Backend, meshlift_per_shard: bool) -> Any:
    """`models.train_step` as this backend's capabilities say its gradients behave."""
    return models.train_step(meshlift_per_shard, VMA_GRADIENTS in meshlift_backend.capabilities)


def _devices() -> list[Any]:
    needed = MESH_SHAPE["data"] * MESH_SHAPE["model"]
    devices = jax.devices()
    if len(devices) < needed:
        devices = jax.devices("cpu")
    if len(devices) < needed:
        pytest.fail(
            f"meshlift's conformance kit needs {needed} devices and found {len(devices)}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before jax starts"
        )
    return devices[:needed]


@pytest.fixture(scope="session")
def meshlift_mesh() -> jax.sharding.Mesh:
    """A `{"data": 2, "model": 4}` mesh with Auto axes."""
    return ml.make_mesh(MESH_SHAPE, devices=_devices())
