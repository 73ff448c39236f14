"""What the oracle compares: outputs, state and object identities, as plain data.

`Identities` names every graph node and Variable of a program's models by
where it first was (`m0.sub.w0`), so that after any number of calls the
state of two runs can be compared object by object: `describe` gives, for
every path reachable from the models, the object's kind, type, name (or
`new`, with where it was first met, for one made since) and value. Two
runs agree when their descriptions are equal, values to a tolerance.

Example:

```python
from meshlift.testing.oracle.observe import Identities, differences
from meshlift.testing.oracle.vocabulary import Box, grid

def run():
    model = Box(w0=nnx.Param(grid((8,), 0)))
    names = Identities({"m0": model})
    model.w1 = model.w0                        # an alias
    return names.describe({"m0": model})

assert run()["m0.w1"][2] == "m0.w0"            # the object first seen at m0.w0
assert differences(run(), run()) == []
```
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshlift.graph.split import is_graph_leaf
from meshlift.testing.oracle.vocabulary import attributes, number

TOLERANCE = 1e-5


def _walk(roots: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(path, object) for everything reachable from the roots, each node's contents once."""
    seen: set[int] = set()

    def visit(x: Any, path: str) -> Iterator[tuple[str, Any]]:
        yield path, x
        if not is_graph_leaf(x) or isinstance(x, nnx.Variable) or id(x) in seen:
            return
        seen.add(id(x))
        for name, value in sorted(attributes(x).items()):
            yield from visit(value, f"{path}.{name}")

    for name, root in roots.items():
        yield from visit(root, name)


def value_of(x: Any) -> Any:
    """An array's value as NumPy (a PRNG key's data), or a deleted marker."""
    if isinstance(x, jax.Array):
        if x.is_deleted():
            return "<deleted>"
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
    return np.asarray(x)


class Identities:
    """Names for the graph nodes and Variables reachable from a program's models."""

    def __init__(self, roots: Mapping[str, Any]):
        self._names: dict[int, str] = {}
        self._alive: list[Any] = []  # held, so that no id is reused while we name by id
        for path, x in _walk(roots):
            if is_graph_leaf(x) and id(x) not in self._names:
                self._names[id(x)] = path
                self._alive.append(x)

    def name(self, x: Any, path: str, new: dict[int, str]) -> str:
        """The name of `x`, met at `path`; `new:<path>` for an object made later."""
        if id(x) in self._names:
            return self._names[id(x)]
        if id(x) not in new:
            new[id(x)] = f"new:{path}"
            self._alive.append(x)
        return new[id(x)]

    def describe(self, roots: Mapping[str, Any]) -> dict[str, tuple]:
        """Path -> (kind, type, name, value) of everything reachable from the roots."""
        new: dict[int, str] = {}
        return {path: self._describe(x, path, new) for path, x in _walk(roots)}

    def describe_output(self, out: Any) -> dict[str, tuple]:
        """An output as `describe` gives state: its arrays, and graph nodes by name."""
        new: dict[int, str] = {}
        described: dict[str, tuple] = {}
        leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_graph_leaf)[0]
        for keys, leaf in leaves:
            path = "out" + jax.tree_util.keystr(keys)
            if is_graph_leaf(leaf):
                for inner, x in _walk({path: leaf}):
                    described[inner] = self._describe(x, inner, new)
            else:
                described[path] = self._describe(leaf, path, new)
        return described

    def _describe(self, x: Any, path: str, new: dict[int, str]) -> tuple:
        if isinstance(x, nnx.Variable):
            raw = x.get_raw_value()
            if hasattr(raw, "dtype"):
                value = value_of(raw if isinstance(raw, jax.Array) else x[...])
            else:  # a pytree: each array by its key path
                leaves = jax.tree_util.tree_flatten_with_path(x.get_value())[0]
                value = tuple((jax.tree_util.keystr(k), value_of(v)) for k, v in leaves)
            return ("variable", type(x).__name__, self.name(x, path, new), value)
        if is_graph_leaf(x):
            return ("node", type(x).__name__, self.name(x, path, new), None)
        if isinstance(x, jax.Array | np.ndarray):
            return ("array", "array", "", value_of(x))
        if isinstance(x, int | float | bool | complex) and not isinstance(x, np.generic):
            return ("scalar", type(x).__name__, "", x)
        return ("static", type(x).__name__, "", number(x))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind in "fc":
            return bool(np.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE, equal_nan=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= TOLERANCE * (1 + abs(a))
    if isinstance(a, tuple) and isinstance(b, tuple):  # a pytree's (key path, value) pairs
        return len(a) == len(b) and all(
            ka == kb and _same_value(va, vb) for (ka, va), (kb, vb) in zip(a, b, strict=True)
        )
    return type(a) is type(b) and a == b


def _shown(entry: tuple) -> str:
    """One described object on one line: its first values where it is an array."""
    kind, type_name, name, value = entry
    shown = (
        "{" + ", ".join(f"{k}: {_array(v)}" for k, v in value) + "}"
        if isinstance(value, tuple)
        else _array(value)
    )
    return f"{kind} {type_name}" + (f" {name}" if name else "") + f" = {shown}"


def _array(value: Any) -> Any:
    """An array's dtype, shape and first values; anything else as itself."""
    if not isinstance(value, np.ndarray):
        return value
    first = " ".join(f"{v:.4g}" for v in value.ravel()[:4].tolist())
    more = " ..." if value.size > 4 else ""
    return f"{value.dtype}{list(value.shape)} [{first}{more}]"


def differences(expected: Mapping[str, tuple], actual: Mapping[str, tuple]) -> list[str]:
    """Where two descriptions differ, one line each (empty if they agree)."""
    lines = [f"`{p}` missing (expected {_shown(expected[p])})" for p in expected if p not in actual]
    lines += [f"`{p}` unexpected ({_shown(actual[p])})" for p in actual if p not in expected]
    for path in expected.keys() & actual.keys():
        a, b = expected[path], actual[path]
        if a[:3] != b[:3] or not _same_value(a[3], b[3]):
            lines.append(f"`{path}`: expected {_shown(a)}, got {_shown(b)}")
    return sorted(lines)
