"""Eight simulated CPU devices, set before anything imports jax; meshes and the old mesh context."""

import contextlib
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

import meshlift as ml

# jax's `with mesh:` DeprecationWarning exists from jax 0.10.1 on; before it the old
# context is entered silently.
WITH_MESH_WARNS = jax.__version_info__ >= (0, 10, 1)


@pytest.fixture(scope="session")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="session")
def mesh_4x2():
    return ml.make_mesh({"data": 4, "model": 2})


@contextlib.contextmanager
def _old_style(mesh):
    warns = (
        pytest.warns(DeprecationWarning, match="with mesh")
        if WITH_MESH_WARNS
        else contextlib.nullcontext()
    )
    with warns, mesh:
        yield mesh


@pytest.fixture
def old_style():
    """``with old_style(mesh):`` is the deprecated ``with mesh:``, asserting jax's warning
    where the installed jax emits it (0.10.1 and later)."""
    return _old_style
