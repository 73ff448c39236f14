"""Eight simulated CPU devices, set before anything imports jax; meshes and the old mesh context."""

import contextlib
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

import meshlift as ml


@pytest.fixture(scope="session")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="session")
def mesh_4x2():
    return ml.make_mesh({"data": 4, "model": 2})


@contextlib.contextmanager
def _old_style(mesh):
    with pytest.warns(DeprecationWarning, match="with mesh"), mesh:
        yield mesh


@pytest.fixture
def old_style():
    """``with old_style(mesh):`` is the deprecated ``with mesh:``, asserting jax's warning."""
    return _old_style
