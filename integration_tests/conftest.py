"""Eight simulated CPU devices, set before anything imports jax; tables printed as piped."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


@pytest.fixture(autouse=True)
def _tables_as_piped(monkeypatch):
    """Tables print as when piped (rich's 80 columns), whatever $COLUMNS the shell sets."""
    monkeypatch.delenv("COLUMNS", raising=False)
