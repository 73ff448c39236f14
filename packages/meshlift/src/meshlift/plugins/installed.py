"""What `ml.backends()` reports: the installed backends and the plugins that failed to load.

Example:

```python
installed = ml.backends()
print(installed)            # Installed backends: ... (and any that failed to load)
assert all(isinstance(b, ml.plugins.installed.BackendInfo) for b in installed)
```
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from meshlift.backend import Backend, origin


@attrs.frozen
class BackendInfo:
    """What `ml.backends()` reports about one installed backend.

    Attributes:
        name: The backend's name.
        distribution: Its distribution; None: registered in this process.
        version: Its version.
        capabilities: Its capabilities, sorted.
        description: Its one-line description.
    """

    name: str
    distribution: str | None
    version: str
    capabilities: tuple[str, ...]
    description: str

    @classmethod
    def from_backend(cls, backend: Backend) -> BackendInfo:
        """The report of `backend`.

        Args:
            backend: A registered backend.

        Returns:
            Its `BackendInfo`.
        """
        return cls(
            name=backend.name,
            distribution=backend.distribution,
            version=backend.version,
            capabilities=tuple(sorted(backend.capabilities)),
            description=backend.description,
        )

    def __str__(self) -> str:
        caps = ", ".join(self.capabilities) or "-"
        return (
            f"{self.name} ({origin(self.distribution, self.version)}) [{caps}] {self.description}"
        )


@attrs.frozen
class LoadError:
    """A plugin that failed to load: its entry point, distribution and error.

    Attributes:
        plugin: The entry point's name.
        distribution: The distribution of the entry point, if known.
        version: That distribution's version, if known.
        error: The error, as `"TypeError: message"`.
    """

    plugin: str
    distribution: str | None
    version: str | None
    error: str

    def __str__(self) -> str:
        return f"{self.plugin} ({origin(self.distribution, self.version)}): {self.error}"


@attrs.frozen
class InstalledBackends:
    """The installed backends, by name, and the plugins that failed to load.

    Iterates over the backends; `print()` it for a summary.

    Attributes:
        backends: One `BackendInfo` per usable backend, by name.
        errors: One `LoadError` per plugin that failed to load, or name two claimed.

    Example:

    ```python
    installed = ml.backends()
    assert sorted(b.name for b in installed) == ["jit", "pipeline", "pjit", "shard_map"]  # the in-repo four
    assert installed.errors == ()
    ```
    """

    backends: tuple[BackendInfo, ...]
    errors: tuple[LoadError, ...]

    def __iter__(self) -> Iterator[BackendInfo]:
        return iter(self.backends)

    def __len__(self) -> int:
        return len(self.backends)

    def __str__(self) -> str:
        lines = ["Installed backends:"]
        lines += [f"  {b}" for b in self.backends] or ["  none"]
        if self.errors:
            lines.append("Plugins that failed to load:")
            lines += [f"  {e}" for e in self.errors]
        return "\n".join(lines)
