"""Plugin loading and the backend registry.

Backends come from plugins published under the ``meshlift`` entry-point group
(see `meshlift.hookspecs`). The registry is filled the first time it is
used: each entry point is loaded on its own, so one broken plugin is recorded
with its error and the others still load.

Environment variables, read when the registry is (re)loaded:

- ``MESHLIFT_STRICT_PLUGINS=1`` re-raises the first plugin error instead of
  recording it.
- ``MESHLIFT_DISABLE_PLUGINS=a,b`` skips entry points, or backends, by name.

Example::

    import meshlift as ml

    print(ml.backends())            # what is installed, and what failed to load
    backend = ml.get_backend("jit")
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.metadata import Distribution, entry_points

import attrs
import pluggy

from meshlift import hookspecs
from meshlift.backend import Backend

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "STRICT_ENV",
    "BackendInfo",
    "BackendNotFoundError",
    "InstalledBackends",
    "LoadError",
    "PluginError",
    "backends",
    "get_backend",
    "plugin_manager",
    "register_backend",
    "register_plugin",
    "reset_registry",
]

ENTRY_POINT_GROUP = "meshlift"
STRICT_ENV = "MESHLIFT_STRICT_PLUGINS"
DISABLE_ENV = "MESHLIFT_DISABLE_PLUGINS"

_DEFAULT_VERSION = attrs.fields(Backend).version.default


class PluginError(Exception):
    """A plugin registered something meshlift cannot accept."""


class BackendNotFoundError(LookupError):
    """No installed backend has the requested name.

    The message lists the installed backends and the distribution to install.
    """


@attrs.frozen
class BackendInfo:
    """What ``ml.backends()`` reports about one installed backend."""

    name: str
    distribution: str | None
    version: str
    capabilities: tuple[str, ...]
    description: str

    @classmethod
    def from_backend(cls, backend: Backend) -> BackendInfo:
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
            f"{self.name} ({_origin(self.distribution, self.version)}) [{caps}] {self.description}"
        )


@attrs.frozen
class LoadError:
    """A plugin that failed to load: its entry point, distribution and error."""

    plugin: str
    distribution: str | None
    version: str | None
    error: str

    def __str__(self) -> str:
        return f"{self.plugin} ({_origin(self.distribution, self.version)}): {self.error}"


@attrs.frozen
class InstalledBackends:
    """The installed backends and the plugins that failed to load.

    Iterates over the backends; ``print()`` it for a summary.

    Example::

        >>> installed = ml.backends()
        >>> sorted(b.name for b in installed)      # with the three in-repo backends
        ['jit', 'pjit', 'shard_map']
        >>> installed.errors
        ()
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


@attrs.define
class _Registry:
    pm: pluggy.PluginManager
    disabled: frozenset[str]
    backends: dict[str, Backend] = attrs.field(factory=dict)
    errors: list[LoadError] = attrs.field(factory=list)

    def installed(self) -> InstalledBackends:
        return InstalledBackends(
            backends=tuple(BackendInfo.from_backend(b) for b in self.backends.values()),
            errors=tuple(self.errors),
        )


_registry: _Registry | None = None


def backends() -> InstalledBackends:
    """Describe the installed backends and any plugins that failed to load.

    Example::

        >>> sorted(b.name for b in ml.backends())
        ['jit', 'pjit', 'shard_map']
        >>> print(ml.backends())
        Installed backends:
          jit (meshlift-jit 0.1.0) [...] ...
    """
    return _get_registry().installed()


def get_backend(backend: str | Backend) -> Backend:
    """Return the backend registered under a name, or a ``Backend`` object as is.

    Passing an object lets an unpublished backend run without registering it.

    Example::

        >>> ml.get_backend("jit").name
        'jit'
        >>> mine = ml.Backend(name="mine", stage=lambda fn, spec: jax.jit(fn))
        >>> ml.get_backend(mine) is mine
        True
    """
    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"A backend is a name or a meshlift.Backend, got {type(backend).__name__}: {backend!r}."
        )
    registry = _get_registry()
    if backend in registry.backends:
        return registry.backends[backend]
    raise BackendNotFoundError(_not_found_message(backend, registry))


def register_backend(backend: Backend) -> None:
    """Add a backend to this process's registry, as a plugin would.

    Example::

        >>> ml.plugins.register_backend(ml.Backend(name="mine", stage=my_stage))
        >>> ml.get_backend("mine").name
        'mine'
    """
    _add_backend(_get_registry(), backend, distribution=None)


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object (module, class or instance) and its backends now.

    Errors are raised, not recorded. Example::

        class MyPlugin:
            @ml.hookimpl
            def meshlift_register_backends(self, register):
                register(ml.Backend(name="mine", stage=my_stage))

        ml.plugins.register_plugin(MyPlugin())
    """
    _add_plugin(_get_registry(), plugin, name, distribution=None)


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy ``PluginManager("meshlift")`` holding every loaded plugin."""
    return _get_registry().pm


def reset_registry() -> None:
    """Forget loaded plugins and registered backends; the next use reloads them.

    Environment variables are read again on reload, which is what tests need.
    """
    global _registry
    _registry = None


def _get_registry() -> _Registry:
    global _registry
    if _registry is None:
        _registry = _load()
    return _registry


def _load() -> _Registry:
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    disabled = frozenset(
        name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()
    )
    for name in disabled:
        pm.set_blocked(name)
    registry = _Registry(pm=pm, disabled=disabled)
    strict = os.environ.get(STRICT_ENV, "").lower() in {"1", "true", "yes"}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if pm.is_blocked(ep.name):
            continue
        try:
            _add_plugin(registry, ep.load(), ep.name, ep.dist)
        except Exception as error:
            record = LoadError(
                plugin=ep.name,
                distribution=ep.dist.name if ep.dist else None,
                version=ep.dist.version if ep.dist else None,
                error=f"{type(error).__name__}: {error}",
            )
            if strict:
                error.add_note(
                    f"Raised while loading meshlift plugin {record.plugin!r} "
                    f"({_origin(record.distribution, record.version)}). Unset {STRICT_ENV} "
                    f"to skip broken plugins, or set {DISABLE_ENV}={record.plugin}."
                )
                raise
            registry.errors.append(record)
    return registry


def _add_plugin(
    registry: _Registry, plugin: object, name: str | None, distribution: Distribution | None
) -> None:
    """Register ``plugin`` and call its hook: all of its backends are added, or none."""
    pm = registry.pm
    if pm.register(plugin, name=name) is None:  # blocked by MESHLIFT_DISABLE_PLUGINS
        return
    staged = attrs.evolve(registry, backends=dict(registry.backends))
    others = [p for p in pm.get_plugins() if p is not plugin]
    try:
        pm.subset_hook_caller("meshlift_register_backends", others)(
            register=lambda backend: _add_backend(staged, backend, distribution)
        )
    except BaseException:
        pm.unregister(plugin)
        raise
    registry.backends = staged.backends


def _add_backend(registry: _Registry, backend: Backend, distribution: Distribution | None) -> None:
    if not isinstance(backend, Backend):
        raise PluginError(
            f"register() takes a meshlift.Backend, got {type(backend).__name__}: {backend!r}. "
            f"Wrap the transform as meshlift.Backend(name=..., stage=...)."
        )
    if backend.name in registry.disabled:
        return
    if distribution is not None:
        backend = attrs.evolve(
            backend,
            distribution=backend.distribution or distribution.name,
            version=distribution.version
            if backend.version == _DEFAULT_VERSION
            else backend.version,
        )
    existing = registry.backends.get(backend.name)
    if existing is not None:
        raise PluginError(
            f"Two backends are named {backend.name!r}: one from "
            f"{_origin(existing.distribution, existing.version)}, one from "
            f"{_origin(backend.distribution, backend.version)}. Uninstall one, or skip one "
            f"with {DISABLE_ENV}=<its entry point name>."
        )
    registry.backends[backend.name] = backend


def _not_found_message(name: str, registry: _Registry) -> str:
    if name in registry.disabled:
        fix = f"It is disabled: remove {name!r} from {DISABLE_ENV} to use it."
    else:
        fix = f"Install it with: pip install meshlift-{name.replace('_', '-')}"
    return f"No meshlift backend named {name!r}. {fix}\n{registry.installed()}"


def _origin(distribution: str | None, version: str | None) -> str:
    if distribution is None:
        return "registered in this process"
    return f"{distribution} {version}"
