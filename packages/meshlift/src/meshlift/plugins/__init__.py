"""Plugin loading and the backend registry.

Backends come from plugins published under the `meshlift` entry-point group
(see `meshlift.hookspecs`). The registry is filled the first time it is
used: each entry point is loaded on its own, so one broken plugin is recorded
with its error and the others still load. "Broken" includes a plugin that
raises `SystemExit` (or any other `BaseException` but
`KeyboardInterrupt`) at import or in its hook.

The names of the core's front ends (`FRONT_ENDS`: `ml.jit`, `ml.shard_map`,
`ml.pjit`) belong to the distributions the core's extras of the same names
install (`pip install 'meshlift[jit]'`; `meshlift.plugins.first_party` reads them
from the core's metadata): `ml.jit` and friends always run their own
distribution's backend. Another plugin that registers one of these names is
recorded as a load error, whatever the load order, and its other backends are
not added. Two other plugins that register the same name: neither is used,
whatever the load order; each is recorded as a load error naming both.

Asking for a name that is not installed raises `BackendNotFoundError`, which
lists what is installed and what failed to load, and says what to do: which
distribution to install (first-party names only), how to re-enable a disabled
name, or which installed name is close ("did you mean 'shard_map'?").

Environment variables, read when the registry is (re)loaded:

- `MESHLIFT_STRICT_PLUGINS=1` re-raises the first plugin error instead of
  recording it.
- `MESHLIFT_DISABLE_PLUGINS=a,b` skips entry points, or backends, by name.

Example:

```python
import meshlift as ml

print(ml.backends())            # what is installed, and what failed to load
backend = ml.get_backend("jit")
```
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Iterable
from importlib.metadata import Distribution, entry_points
from typing import Any

import attrs
import pluggy

from meshlift import hookspecs
from meshlift.backend import Backend, origin
from meshlift.errors import BackendNotFoundError, PluginError
from meshlift.plugins.first_party import FRONT_ENDS, canonical, first_party_backends, fold
from meshlift.plugins.installed import BackendInfo, InstalledBackends, LoadError

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "FRONT_ENDS",
    "STRICT_ENV",
    "BackendInfo",
    "BackendNotFoundError",
    "InstalledBackends",
    "LoadError",
    "PluginError",
    "backends",
    "first_party_backends",
    "get_backend",
    "get_frontend",
    "plugin_manager",
    "register_backend",
    "register_plugin",
    "reset_registry",
]

ENTRY_POINT_GROUP = "meshlift"
STRICT_ENV = "MESHLIFT_STRICT_PLUGINS"
DISABLE_ENV = "MESHLIFT_DISABLE_PLUGINS"

_DEFAULT_VERSION = attrs.fields(Backend).version.default
_HOOKS = tuple(name for name in vars(hookspecs) if name.startswith("meshlift_"))


@attrs.define
class _Registry:
    pm: pluggy.PluginManager
    disabled: frozenset[str]
    backends: dict[str, Backend] = attrs.field(factory=dict)
    errors: list[LoadError] = attrs.field(factory=list)
    origins: dict[str, str] = attrs.field(factory=dict)  # plugin name -> where it came from
    registrants: dict[str, str | None] = attrs.field(factory=dict)  # backend -> its plugin
    # a backend name two plugins register -> each (backend, plugin): neither is used
    clashes: dict[str, list[tuple[Backend, str]]] = attrs.field(factory=dict)

    def installed(self) -> InstalledBackends:
        clashes = [
            LoadError(plugin, backend.distribution, backend.version, f"PluginError: {message}")
            for name, claims in self.clashes.items()
            for message in [_clash_message(name, claims)]
            for backend, plugin in sorted(claims, key=_claim_order)
        ]
        return InstalledBackends(  # by name: the same whatever the order plugins loaded in
            backends=tuple(
                BackendInfo.from_backend(self.backends[n]) for n in sorted(self.backends)
            ),
            errors=(*self.errors, *clashes),
        )


_registry: _Registry | None = None


def backends() -> InstalledBackends:
    """Describe the installed backends and any plugins that failed to load.

    Loads the plugins on first use.

    Returns:
        An `InstalledBackends`: iterate it for each `BackendInfo`, print it for a summary.

    Raises:
        BaseException: With `MESHLIFT_STRICT_PLUGINS=1`, the error of the first plugin
            that fails to load, re-raised.

    Example:

    ```python
    assert sorted(b.name for b in ml.backends()) == ["jit", "pipeline", "pjit", "shard_map"]
    print(ml.backends())
    # Installed backends:
    #   jit (meshlift-jit 0.1.0) [...] ...
    ```
    """
    return _get_registry().installed()


def get_backend(backend: str | Backend) -> Backend:
    """Return the backend registered under a name, or a `Backend` object as is.

    Passing an object lets an unpublished backend run without registering it.

    Args:
        backend: A registered name, or a `Backend` (returned unchanged).

    Returns:
        The `Backend`.

    Raises:
        TypeError: If `backend` is neither a string nor a `Backend`.
        BackendNotFoundError: If no installed backend has that name; the message says
            what to install or enable.
        PluginError: If two plugins register that name (neither is used).

    Example:

    ```python
    assert ml.get_backend("jit").name == "jit"
    mine = ml.Backend(name="mine", stage=lambda fn, spec: jax.jit(fn))
    assert ml.get_backend(mine) is mine
    ```
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
    if backend in registry.clashes:
        raise PluginError(_clash_message(backend, registry.clashes[backend]))
    raise BackendNotFoundError(_not_found_message(backend, registry))


def get_frontend(name: str) -> Callable[..., Any]:
    """The user-facing wrapper of an installed backend, with its transform's own argument
    names: what `ml.jit` calls for "jit", or a third party's (`"pmap"`).

    The names of `FRONT_ENDS` only their own distributions can register
    (`first_party_backends`), so `ml.jit` always reaches `meshlift-jit`'s.

    Args:
        name: The backend's name: one of `FRONT_ENDS` or a third party's.

    Returns:
        The backend's `frontend` callable.

    Raises:
        BackendNotFoundError: If no installed backend has that name.
        PluginError: If the backend has no front end, or two plugins register the name.

    Example:

    ```python
    double = ml.get_frontend("jit")(lambda x: 2 * x)  # same as ml.jit
    assert double(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
    ```
    """
    if name not in FRONT_ENDS:
        third_party = get_backend(name)
        if third_party.frontend is None:
            raise PluginError(
                f"The {name!r} backend ({third_party.origin}) has no front end: call it as "
                f"ml.transform({name!r}, fun, mesh=..., in_specs=..., out_specs=...)."
            )
        return third_party.frontend
    distribution = first_party_backends().get(name, f"the distribution of ml.{name}")
    registry = _get_registry()
    backend = registry.backends.get(name)
    if backend is None:
        raise BackendNotFoundError(
            _not_found_message(
                name, registry, headline=f"ml.{name} needs the {name!r} backend, which is missing"
            )
        )
    if backend.frontend is None:
        raise PluginError(
            f"The {name!r} backend ({backend.origin}) has no "
            f"front end, so ml.{name} cannot call it. Reinstall {distribution}: "
            f"pip install --force-reinstall {distribution}"
        )
    return backend.frontend


def register_backend(backend: Backend) -> None:
    """Add a backend to this process's registry, as a plugin would.

    Args:
        backend: The backend to add under its `name`.

    Raises:
        PluginError: If `backend` is not a `Backend`, its name is taken, or it takes a
            first-party name (`jit`...) while claiming another distribution.

    Example:

    ```python
    def my_stage(fn, spec):
        return jax.jit(fn)

    ml.plugins.register_backend(ml.Backend(name="mine", stage=my_stage))
    assert ml.get_backend("mine").name == "mine"
    ```
    """
    _add_backend(_get_registry(), backend, distribution=None)


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object (module, class or instance) and its backends now.

    Errors are raised, not recorded.

    Args:
        plugin: An object with `@ml.hookimpl` functions named after the hooks.
        name: The plugin's name; None: pluggy's canonical name for the object.

    Raises:
        PluginError: If a plugin of that name is registered already, or a backend it
            registers is refused (as by `register_backend`).
        pluggy.PluginValidationError: If it implements no hook, marks a function that is
            no hook, or leaves a `meshlift_*` hook unmarked.

    Example:

    ```python
    def my_stage(fn, spec):
        return jax.jit(fn)

    class MyPlugin:
        @ml.hookimpl
        def meshlift_register_backends(self, register):
            register(ml.Backend(name="mine", stage=my_stage))

    ml.plugins.register_plugin(MyPlugin())
    ```
    """
    _add_plugin(_get_registry(), plugin, name, distribution=None)


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy `PluginManager("meshlift")` holding every loaded plugin.

    Returns:
        The `pluggy.PluginManager`; the plugins are loaded if they were not yet.
    """
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
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit too: a plugin never ends the process
            record = LoadError(
                plugin=ep.name,
                distribution=ep.dist.name if ep.dist else None,
                version=ep.dist.version if ep.dist else None,
                error=_describe(error),
            )
            if strict:
                error.add_note(
                    f"Raised while loading meshlift plugin {record.plugin!r} "
                    f"({origin(record.distribution, record.version)}). Unset {STRICT_ENV} "
                    f"to skip broken plugins, or set {DISABLE_ENV}={record.plugin}."
                )
                raise
            registry.errors.append(record)
    return registry


def _add_plugin(
    registry: _Registry, plugin: object, name: str | None, distribution: Distribution | None
) -> None:
    """Register `plugin` and call its hook: all of its backends are added, or none."""
    pm = registry.pm
    source = origin(*(distribution.name, distribution.version) if distribution else (None, None))
    if name is not None and pm.get_plugin(name) is not None:
        first = registry.origins.get(name, source)
        raise PluginError(
            f"Two plugins are named {name!r}: one from {first}, one from {source}. meshlift "
            f"loads one plugin per name: uninstall one, or rename its entry point."
        )
    if pm.register(plugin, name=name) is None:  # blocked by MESHLIFT_DISABLE_PLUGINS
        return
    registry.origins[pm.get_name(plugin) or ""] = source
    try:
        _check_hooks(pm, plugin)
    except pluggy.PluginValidationError:
        pm.unregister(plugin)
        raise
    staged = attrs.evolve(
        registry,
        backends=dict(registry.backends),
        registrants=dict(registry.registrants),
        clashes={name: list(claims) for name, claims in registry.clashes.items()},
    )
    others = [p for p in pm.get_plugins() if p is not plugin]
    plugin_name = pm.get_name(plugin)
    try:
        pm.subset_hook_caller("meshlift_register_backends", others)(
            register=lambda backend: _add_backend(staged, backend, distribution, plugin_name)
        )
    except BaseException:
        pm.unregister(plugin)
        raise
    registry.backends, registry.registrants = staged.backends, staged.registrants
    registry.clashes = staged.clashes


def _check_hooks(pm: pluggy.PluginManager, plugin: object) -> None:
    """Refuse a plugin whose hooks meshlift would not call, as pytest refuses unknown hooks:
    a function marked `@ml.hookimpl` or named `meshlift_*` that is no hook, a hook left
    unmarked, or no hook at all: pluggy's PluginValidationError, naming the function and
    where it is defined."""
    callers = pm.get_hookcallers(plugin) or []
    marked = {caller.name for caller in callers}
    for function_name in sorted(marked | {n for n in dir(plugin) if n.startswith("meshlift_")}):
        function = getattr(plugin, function_name, None)
        if not callable(function) or (function_name in _HOOKS and function_name in marked):
            continue
        where = f"{function_name}() at {_where(function)}"
        if function_name in _HOOKS:
            raise pluggy.PluginValidationError(
                plugin,
                f"The plugin defines {where} but does not mark it @meshlift.hookimpl, so "
                f"meshlift would never call it. Decorate it: @ml.hookimpl",
            )
        close = difflib.get_close_matches(function_name, _HOOKS, n=1)
        raise pluggy.PluginValidationError(
            plugin,
            f"The plugin defines {where}, which is not a meshlift hook"
            + (f"; did you mean {close[0]}?" if close else ".")
            + f" meshlift's hooks: {', '.join(_HOOKS)} (meshlift.hookspecs).",
        )
    if not marked:
        raise pluggy.PluginValidationError(
            plugin,
            f"The plugin implements no meshlift hook, so it adds nothing. Define "
            f"`@ml.hookimpl def meshlift_register_backends(register): ...` in it "
            f"(meshlift.hookspecs lists the hooks: {', '.join(_HOOKS)}).",
        )


def _where(function: Any) -> str:
    """`path/to/file.py:12`, or the function's qualified name if it has no source file."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return getattr(function, "__qualname__", repr(function))
    return f"{code.co_filename}:{code.co_firstlineno}"


def _add_backend(
    registry: _Registry,
    backend: Backend,
    distribution: Distribution | None,
    plugin: str | None = None,
) -> None:
    """Add one backend from `plugin` (of `distribution`; `None`: this process)."""
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
    _check_first_party_name(backend, distribution, plugin)
    name = backend.name
    rival = registry.registrants.get(name)
    if plugin is not None and name in registry.clashes:
        registry.clashes[name].append((backend, plugin))
        return
    existing = registry.backends.get(name)
    if existing is not None and plugin is not None and rival is not None and rival != plugin:
        # Two plugins, one name: neither is used, whichever loaded first.
        registry.clashes[name] = [(existing, rival), (backend, plugin)]
        del registry.backends[name], registry.registrants[name]
        return
    if existing is not None:
        raise PluginError(
            f"Two backends are named {backend.name!r}: one from {existing.origin}, one from "
            f"{backend.origin}. Uninstall one, or skip one with {DISABLE_ENV}=<its entry point "
            f"name>."
        )
    registry.backends[name] = backend
    registry.registrants[name] = plugin


def _clash_message(name: str, claims: list[tuple[Backend, str]]) -> str:
    """Why `name` is unusable: the plugins that register it, in an order that does not
    depend on which loaded first."""
    ordered = sorted(claims, key=_claim_order)
    each = [f"{b.origin} (plugin {p!r})" for b, p in ordered]
    return (
        f"The backend name {name!r} is registered by {', '.join(each[:-1])} and by "
        f"{each[-1]}, so meshlift uses none of them rather than pick one by install order. "
        f"Uninstall one, or disable one: {DISABLE_ENV}={ordered[-1][1]}."
    )


def _claim_order(claim: tuple[Backend, str]) -> tuple[str, str]:
    backend, plugin = claim
    return backend.origin, plugin


def _check_first_party_name(
    backend: Backend, distribution: Distribution | None, plugin: str | None
) -> None:
    """Raise if `backend` takes a first-party name from another distribution.

    The distribution is the entry point's, not what the backend says it is;
    a backend registered in this process is taken at its word.
    """
    owner = first_party_backends().get(backend.name)
    source = distribution.name if distribution is not None else backend.distribution
    if owner is None or (source is not None and canonical(source) == owner):
        return
    if distribution is not None:
        taker = f"{distribution.name} {distribution.version}"
        fix = (
            f"Rename the backend in {distribution.name}, or disable the plugin with "
            f"{DISABLE_ENV}={plugin or '<its entry point name>'}."
        )
    else:
        taker = (
            f"{backend.distribution} {backend.version}"
            if backend.distribution is not None
            else "a backend registered in this process"
        )
        fix = "Rename the backend, or pass the Backend object itself where a name is accepted."
    raise PluginError(
        f"The backend name {backend.name!r} belongs to {owner} (ml.{backend.name} runs it), "
        f"so {taker} cannot take it. {fix}"
    )


def _not_found_message(name: str, registry: _Registry, headline: str | None = None) -> str:
    """Why `name` is not in the registry, what to do, and what is installed."""
    headline = headline or f"No meshlift backend named {name!r}"
    return f"{headline}{_how_to_get(name, registry)}\n{registry.installed()}"


def _how_to_get(name: str, registry: _Registry) -> str:
    """The rest of the not-found sentence: the one fix that applies to `name`."""
    distribution = first_party_backends().get(name)
    it = f"It comes with {distribution}, which" if distribution else "It"
    if name in registry.disabled:
        return f". {it} is disabled: remove {name!r} from {DISABLE_ENV} to use it."
    if distribution is None:
        matches = _close_matches(name, registry.backends)
        if matches:
            return f"; did you mean {' or '.join(map(repr, matches))}?"
        for e in registry.errors:
            if fold(e.plugin) == fold(name):
                return (
                    f". Its plugin {e.plugin!r} ({origin(e.distribution, e.version)}) failed "
                    f"to load: {e.error}"
                )
        if registry.errors:
            return (
                f". No installed plugin provides it, and {len(registry.errors)} failed to "
                f"load (below): it may be one of them."
            )
        return ". No installed plugin provides it; `meshlift backends` lists what is installed."
    if any(canonical(e.distribution or "") == distribution for e in registry.errors):
        return f". {it} failed to load (error below)."
    return (
        f". It comes with {distribution}: pip install {distribution} "
        f"(from the meshlift repository: pip install ./plugins/{distribution})."
    )


def _close_matches(name: str, names: Iterable[str]) -> list[str]:
    """The names close to `name`, best first, with `-` and `_` (and case) alike."""
    by_key = {fold(n): n for n in names}
    return [by_key[key] for key in difflib.get_close_matches(fold(name), by_key, n=3)]


def _describe(error: BaseException) -> str:
    """`"SystemExit: 3"`; the type alone when the error has no message."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
