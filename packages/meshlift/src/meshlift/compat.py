"""Every access to a private jax or flax name, each guarded, none evaluated at import.

Each function has a fallback through public API (slower, or less precise) for a
version that lacks the private name. Every private name used here exists and
behaves, and the whole suite passes (`nox -t compat`), on:

- jax 0.9.2 with flax 0.12.6 (Python 3.11),
- jax 0.10.2 with flax 0.12.8 (Python 3.11),
- jax 0.12.0.1 with flax 0.12.12 (Python 3.12 and 3.13).

The names: `nnx.Variable._raw_value` / `._var_metadata` / `._can_update`,
`flax.nnx.pytreelib.PytreeState`, `flax.nnx.tracers.TraceState`,
`flax.nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache`, `jax._src.state.types.AbstractRef`,
`flax.linen.module._context.module_stack`, `jax.Array._committed`,
`jax._src.core.trace_state_clean`, `jax._src.mesh.get_concrete_mesh`,
`jax._src.mesh.thread_resources`, `jax._src.named_sharding.DuplicateSpecError`,
`jax._src.core.DebugInfo` with `jax._src.api_util.fun_sourceinfo` (a staged function's
`__fun_debug_info__`), `jax._src.source_info_util.register_exclusion`, and a jitted
function's `_jit_info` (the static and donated arguments as `jax.jit` resolved them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx


class VariableSlots(NamedTuple):
    """The slot descriptors holding a Variable's array and metadata dict: reading and writing
    through them skips `get_value`'s copies and hooks (`meshlift.speedups` loops over them)."""

    value: Any
    metadata: Any


@functools.cache
def variable_slots() -> VariableSlots | None:
    """The fast path's slots if this flax has them and they behave, else None (checked once)."""
    try:
        value: Any = inspect.getattr_static(nnx.Variable, "_raw_value")  # a slot
        metadata: Any = inspect.getattr_static(nnx.Variable, "_var_metadata")
        probe = nnx.Param(jax.numpy.zeros(()), probe_tag=1)
        marker = jax.numpy.ones(())
        value.__set__(probe, marker)
        if value.__get__(probe) is not marker or probe.get_raw_value() is not marker:
            return None
        if metadata.__get__(probe).get("probe_tag") != 1:
            return None
    except Exception:  # a flax without these slots: the public API is used instead
        return None
    return VariableSlots(value, metadata)


@functools.cache
def bookkeeping_types() -> tuple[type, ...]:
    """Flax's per-object trace and init state: changes on every trace, never structure."""
    found = []
    for module, name in (("flax.nnx.pytreelib", "PytreeState"), ("flax.nnx.tracers", "TraceState")):
        # a flax without it: such objects are watched like any other
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def can_update(variable: Any) -> bool:
    """Whether `variable` may take a value of the current trace (flax's own check)."""
    check = getattr(variable, "_can_update", None)
    if isinstance(check, bool):
        return check
    return isinstance(variable.get_raw_value(), jax.core.Tracer)


def is_ref(x: Any) -> bool:
    """Whether `x` is a mutable array reference (`jax.Ref`, a `ref=True` Variable's value),
    also inside a trace."""
    ref_type = getattr(jax, "Ref", None)
    if ref_type is not None and isinstance(x, ref_type):
        return True
    abstract = _abstract_ref()
    return abstract is not None and isinstance(getattr(x, "aval", None), abstract)


@functools.cache
def _abstract_ref() -> type | None:
    try:
        from jax._src.state.types import AbstractRef
    except ImportError:
        return None
    return AbstractRef


def new_ref(value: Any) -> Any:
    """A new mutable array reference holding `value` (on its sharding)."""
    return jax.new_ref(value)


class _NoGraphContext:
    tmp_static_cache = None


@functools.cache
def graph_context() -> Any:
    """flax's graph context, whose `tmp_static_cache` `nnx.cached_partial` sets for the
    transform it calls to take (a stand-in holding None on a flax without one)."""
    try:
        from flax.nnx.graphlib import GRAPH_CONTEXT
    except ImportError:
        return _NoGraphContext()
    return GRAPH_CONTEXT if hasattr(GRAPH_CONTEXT, "tmp_static_cache") else _NoGraphContext()


def is_committed(array: jax.Array) -> bool:
    """Whether `array` was placed explicitly, so `jax.jit` refuses it on another sharding."""
    committed = getattr(array, "_committed", None)
    return committed if isinstance(committed, bool) else True


def outside_traces() -> bool:
    """True when no JAX transform is tracing (where `jax.set_mesh` may be entered)."""
    return _trace_state_clean()()


@functools.cache
def _trace_state_clean() -> Callable[[], bool]:
    try:
        from jax._src.core import trace_state_clean
    except ImportError:
        return lambda: False  # unknown: callers act as inside a trace
    return trace_state_clean


def concrete_mesh() -> Any:
    """The mesh of `jax.set_mesh` / `ml.use_mesh`, also inside traces; None if unset."""
    try:
        mesh = mesh_reader()()
    except Exception:  # the public reader refuses inside traces on jax 0.10
        return None
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


@functools.cache
def mesh_reader() -> Callable[[], Any]:
    """jax's reader of the `jax.set_mesh` mesh (it may raise inside traces, or give an empty mesh)."""
    try:
        from jax._src.mesh import get_concrete_mesh
    except ImportError:
        return jax.sharding.get_mesh
    return get_concrete_mesh


@functools.cache
def array_type() -> type | None:
    """The type of every concrete `jax.Array` (never a tracer's); None if this jax hides it."""
    try:
        from jax._src.array import ArrayImpl
    except ImportError:
        return None
    return ArrayImpl if isinstance(ArrayImpl, type) else None


def legacy_mesh() -> Any:
    """The mesh of the deprecated `with mesh:` context, or None."""
    try:
        from jax._src.mesh import thread_resources
    except ImportError:
        return None
    mesh = thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def in_linen_module() -> bool:
    """True while a linen module's `setup` or `__call__` runs (linen's module stack)."""
    try:
        from flax.linen import module as linen_module

        return linen_module._context.module_stack[-1] is not None
    except (ImportError, AttributeError, IndexError):
        return False


@functools.cache
def duplicate_spec_error() -> type[Exception]:
    """jax's `DuplicateSpecError`, what `jax.jit` raises for a spec naming a mesh axis twice
    (`Exception` where jax keeps it elsewhere: then only `except Exception` catches both)."""
    for module in ("jax._src.named_sharding", "jax._src.sharding_impls"):
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), "DuplicateSpecError", None)
            if isinstance(found, type) and issubclass(found, Exception):
                return found
    return Exception


@contextlib.contextmanager
def graph_mode() -> Any:
    """flax's graph mode with graph updates for the block, whatever the user switched on
    (`nnx.set_graph_mode(False)`, `NNX_GRAPH_MODE=false`); a flax without the switches
    has only graph mode."""
    with contextlib.ExitStack() as stack:
        for name in ("set_graph_mode", "set_graph_updates"):
            switch = getattr(nnx, name, None)
            if switch is not None:
                stack.enter_context(switch(True))
        yield


def jit_argnums(jitted: Any) -> tuple[tuple[Any, ...], ...] | None:
    """`(static_argnums, static_argnames, donate_argnums, donate_argnames)` as `jax.jit`
    resolved them for `jitted`, by the installed jax's own rule (jax 0.12 reads a negative
    number against the signature, as a name; jax 0.10 against each call's arguments);
    None where jax keeps no record of them."""
    info = getattr(jitted, "_jit_info", None)
    try:
        return tuple(
            tuple(getattr(info, name))
            for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
        )
    except (AttributeError, TypeError):
        return None


def debug_info(traced_for: str, fun: Callable[..., Any], arg_names: tuple[str, ...]) -> Any:
    """JAX's `DebugInfo` for a function staged in `fun`'s place whose flat inputs are
    `arg_names`: set as its `__fun_debug_info__` (as jax's own wrappers do), JAX's
    messages name `fun` and the caller's arguments. None where jax has no such type.

    Should a call give the staged function another number of arrays than it was named
    for (a Variable of the same object made to hold a pytree), JAX is told no names
    rather than wrong ones."""
    try:
        from jax._src import api_util

        return _caller_names()(traced_for, api_util.fun_sourceinfo(fun), arg_names, None)
    except (ImportError, AttributeError, TypeError):
        return None


@functools.cache
def _caller_names() -> type:
    from jax._src import core

    class CallerNames(core.DebugInfo):
        __slots__ = ()

        def safe_arg_names(self, expected_count: int) -> tuple[str, ...]:
            if self.arg_names is not None and len(self.arg_names) == expected_count:
                return tuple(self.arg_names)
            return ("",) * expected_count

        def assert_arg_names(self, expected_count: int) -> None:
            return None

    return CallerNames


@functools.cache
def hide_from_source_info(directory: str) -> None:
    """Have JAX skip frames under `directory` when it says where user code is ("TRACING
    CACHE MISS at x.py:12", an equation's source line), as it skips its own."""
    with contextlib.suppress(ImportError, AttributeError):
        from jax._src import source_info_util

        source_info_util.register_exclusion(directory)
