"""Dict watchers: one counter that moves whenever any watched dict changes.

CPython 3.12 added dict watchers to its C API (`PyDict_AddWatcher`,
`PyDict_Watch`): the interpreter calls a callback before a watched dict
changes, however it is changed (an item set or deleted, `clear`, `update`, an
attribute assigned on the object whose `__dict__` it is, the dict freed).
meshlift registers one callback, through `ctypes`, that bumps `changes()`, so
`structure.Watcher` can tell that no attribute dict of a model changed by
comparing one number instead of every attribute.

`available()` probes once that every kind of change is reported. Where it is
not (Python 3.11; another interpreter; CPython 3.13.0, where an attribute
stored on an object's inline values changes without telling its dict's
watchers), it is False. On CPython 3.11 a dict tells of its changes another
way: its version tag (PEP 509), which every change sets anew from one global
counter; `versions_available()` probes that every kind of change moves it
(read by `speedups.dict_versions`), and the Watcher then compares one tag per
dict. Where neither is available it compares every attribute.

Example:

```python
from meshlift.graph import dict_watch

config = {"width": 64}
if dict_watch.available():
    dict_watch.watch([config])
    before = dict_watch.changes()
    config["width"] = 128
    assert dict_watch.changes() != before
```
"""

from __future__ import annotations

import atexit
import functools
import math
import platform
import sys
import sysconfig
from collections.abc import Callable, Iterable
from typing import Any

_count: list[float] = [0]


def _on_change(event: int, mapping: int, key: int, value: int) -> int:
    # Runs inside the dict operation: no Python object is touched, nothing can raise.
    _count[0] += 1
    return 0


def changes() -> float:
    """How many changes to watched dicts there have been (0 forever if not `available()`).

    NaN once the watcher is cleared at exit: equal to nothing, so a change
    count taken before never matches again and the structure check compares
    every attribute.
    """
    return _count[0]


def available() -> bool:
    """Whether watched dicts report every change (probed once)."""
    return _watcher() is not None


@functools.cache
def versions_available() -> bool:
    """Whether `speedups.dict_versions` reads a tag that moves on every change of a dict
    (CPython 3.11 with meshlift's C extension; probed once)."""
    from meshlift import speedups

    if platform.python_implementation() != "CPython" or sys.version_info[:2] != (3, 11):
        return False
    if not speedups.COMPILED:
        return False
    return _moves_on_every_change(lambda attributes: lambda: speedups.dict_versions((attributes,)))


def watch(dicts: Iterable[dict]) -> None:
    """Report changes to each of `dicts` (plain dicts only) in `changes()`; a no-op if not available."""
    watcher = _watcher()
    if watcher is not None:
        for mapping in dicts:
            watcher.watch(mapping)


class _Api:
    """The watcher registered with the interpreter; cleared at exit, before dicts are torn down."""

    def __init__(self) -> None:
        import ctypes  # here, not at import: a Python built without it still imports meshlift

        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
        )
        api = ctypes.pythonapi
        prototype = ctypes.PYFUNCTYPE  # holds the GIL and raises the C API's errors
        add = prototype(ctypes.c_int, callback_type)(("PyDict_AddWatcher", api))
        self._watch: Callable[[int, dict], int] = prototype(
            ctypes.c_int, ctypes.c_int, ctypes.py_object
        )(("PyDict_Watch", api))
        self._clear: Callable[[int], int] = prototype(ctypes.c_int, ctypes.c_int)(
            ("PyDict_ClearWatcher", api)
        )
        self._callback = callback_type(_on_change)  # kept alive as long as the watcher
        self.id: int = add(self._callback)
        atexit.register(_stop, self)

    def watch(self, mapping: dict) -> None:
        if self.id >= 0:
            self._watch(self.id, mapping)

    def close(self) -> None:
        if self.id >= 0:
            self._clear(self.id)
            self.id = -1


def _stop(api: _Api) -> None:
    """At exit: no more callbacks, and no count taken before matches again."""
    api.close()
    _count[0] = math.nan


@functools.cache
def _watcher() -> _Api | None:
    if (
        platform.python_implementation() != "CPython"
        or sys.version_info < (3, 12)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
    ):
        return None
    try:
        api = _Api()
    except (ImportError, AttributeError, OSError, RuntimeError, ValueError):  # no C API here
        return None
    if not _moves_on_every_change(lambda attributes: (api.watch(attributes), changes)[1]):
        api.close()
        return None
    return api


class _Probe:
    """A plain heap class: its attributes live on inline values until `__dict__` is read."""

    def __init__(self) -> None:
        self.a = 0


def _store(obj: Any, value: int) -> None:
    obj.a = value  # one bytecode the interpreter specialises after a few runs


def _moves_on_every_change(start: Callable[[dict], Callable[[], Any]]) -> bool:
    """Whether the reading that `start(attributes)` returns moves on each kind of change to
    an object's attribute dict."""
    obj = _Probe()
    attributes = vars(obj)
    read = start(attributes)
    edits: list[Callable[[], Any]] = [
        *(functools.partial(_store, obj, i) for i in range(1, 65)),
        functools.partial(object.__setattr__, obj, "a", -1),
        functools.partial(setattr, obj, "b", 1),
        functools.partial(delattr, obj, "b"),
        functools.partial(attributes.__setitem__, "c", 2),
        functools.partial(attributes.update, c=3),
        functools.partial(attributes.setdefault, "d", 4),
        functools.partial(attributes.pop, "d"),
        attributes.popitem,
        attributes.clear,
    ]
    for edit in edits:
        before = read()
        edit()
        if read() == before:
            return False
    return True
