"""The words oracle programs are written in; a counterexample's snippet imports them.

A program builds models out of `Box` modules holding Variables, arrays,
submodules and static values of many kinds (`STATICS`), defines a function
that changes its arguments with the operations below and returns `probe` of
them, and calls it lifted, changing the models between calls. Every
operation is deterministic and does nothing where its target is missing (an
earlier operation may have removed it), so any sequence of operations is a
valid program, eager and under any transform alike.

Example:

```python
from meshlift.testing.oracle.vocabulary import Box, Config, bump, grid, node, probe, touch

model = Box(w0=nnx.Param(grid((2, 8), 1)), cfg=Config(2.0))

def fn(a, x):
    args = (a, x)
    bump(node(args, 0), "w0", 0.5)     # graph node 0 among the arguments, its `w0`
    return probe(args)

before = probe((model, 1.0))["0.cfg"]
touch(model, "cfg")                    # the config changed in place: `probe` sees it
assert probe((model, 1.0))["0.cfg"] != before
assert set(fn(model, 1.0)) == {"0.w0", "0.cfg", "1"}
```
"""

from __future__ import annotations

import array
import collections
import dataclasses
import enum
import functools
import gc
import types
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshlift import compat
from meshlift.graph.split import is_graph_leaf

__all__ = [
    "STATICS",
    "Box",
    "Color",
    "Config",
    "Frozen",
    "Holder",
    "Key",
    "OtherConfig",
    "OtherHolder",
    "Stat",
    "add",
    "alias",
    "array",
    "at",
    "bump",
    "bump_params",
    "closure",
    "collections",
    "delete",
    "functools",
    "grid",
    "jnp",
    "layers",
    "learn",
    "mode",
    "nested",
    "nnx",
    "node",
    "np",
    "optax",
    "probe",
    "proxy",
    "remeta",
    "replace",
    "reshape",
    "restructure",
    "retype",
    "scaled",
    "setattr_if",
    "swap",
    "swap_class",
    "swap_dict",
    "touch",
    "transformation",
    "types",
]


class Box(nnx.Module):
    """A module whose attributes are given by keyword: `Box(w=nnx.Param(...), cfg=3)`."""

    def __init__(self, **attributes: Any):
        for name, value in attributes.items():
            setattr(self, name, value)


class Stat(nnx.Variable):
    """A Variable type of the program's own: neither a Param nor flax's BatchStat."""


class Color(enum.Enum):
    RED = 1
    GREEN = 2


@dataclasses.dataclass(frozen=True)
class Frozen:
    """A hashable configuration."""

    scale: float


@dataclasses.dataclass
class Config:
    """A mutable, unhashable configuration, changed in place by `touch`."""

    scale: float


class OtherConfig(Config):
    """What `swap_class` turns a `Config` into: the same fields, another type."""


class Holder:
    """A plain object; `Holder(2.0).get` is a bound method as a static value."""

    def __init__(self, scale: float):
        self.scale = scale

    def get(self, x: float) -> float:
        return self.scale * x


class OtherHolder(Holder):
    """What `swap_class` turns a `Holder` into."""

    def get(self, x: float) -> float:
        return self.scale * x + 1


class Key:
    """A mutable object hashed by identity: a dict key whose field `touch` changes."""

    def __init__(self, scale: float):
        self.scale = scale


def scaled(x: float, scale: float, offset: float = 0.0) -> float:
    return x * scale + offset


def closure(scale: float) -> Any:
    """A function closing over a `Config`."""
    config = Config(scale)

    def scale_by(x: float) -> float:
        return x * config.scale

    return scale_by


def proxy(items: dict) -> types.MappingProxyType:
    """A read-only view of `items`, which `touch` changes behind it."""
    return types.MappingProxyType(items)


def _backing(view: types.MappingProxyType) -> dict:
    """The dict behind a mapping proxy."""
    return next(r for r in gc.get_referents(view) if isinstance(r, dict))


# The static values a program may hold, as source text: one per kind of container.
STATICS = {
    "int": "3",
    "float": "2.5",
    "bool": "True",
    "str": '"relu"',
    "none": "None",
    "tuple": "(1, 2.0)",
    "enum": "Color.RED",
    "frozen": "Frozen(1.5)",
    "config": "Config(2.0)",
    "list": "[1.0, 2.0]",
    "dict": '{"scale": 1.0}',
    "set": "{1, 2}",
    "deque": "collections.deque([1.0])",
    "ordered": "collections.OrderedDict(scale=1.0)",
    "default": "collections.defaultdict(float, scale=1.0)",
    "proxy": 'proxy({"scale": 1.0})',
    "bytearray": 'bytearray(b"ab")',
    "memoryview": 'memoryview(bytearray(b"ab"))',
    "array": 'array.array("d", [1.0])',
    "numpy": "Holder(np.array([1.0, 2.0]))",  # a NumPy array on a module would be data
    "partial": "functools.partial(scaled, scale=2.0)",
    "closure": "closure(2.0)",
    "method": "Holder(2.0).get",
    "key": "{Key(1.0): 1.0}",
    "namespace": "types.SimpleNamespace(scale=1.0)",
}


def grid(shape: tuple[int, ...], seed: float, dtype: Any = jnp.float32) -> jax.Array:
    """A small array of distinct values: `seed` picks which."""
    size = int(np.prod(shape))
    values = (np.arange(size) % 7 + 1) * 0.125 + seed
    return jnp.asarray(values.reshape(shape), dtype=dtype)


def nested(seed: float) -> dict[str, Any]:
    """A pytree for a Variable to hold: a dict of a matrix and a tuple of two vectors."""
    return {"a": grid((2, 8), seed), "b": (grid((8,), seed + 0.5), grid((8,), 1.0))}


# -- reading ------------------------------------------------------------------------------


def _crc(text: str) -> float:
    return zlib.crc32(text.encode()) / 2**32


def number(value: Any) -> float:
    """A number from a static value, its type included (`1`, `True` and `1.0` differ)."""
    kind = _crc(type(value).__qualname__)
    if isinstance(value, bool | int | float | str | bytes | enum.Enum) or value is None:
        return kind + _crc(repr(value))
    if isinstance(value, bytearray | memoryview | array.array):
        return kind + _crc(bytes(value).hex())
    if isinstance(value, np.ndarray):
        return kind + _crc(value.tobytes().hex())
    if isinstance(value, Mapping | types.MappingProxyType):
        return kind + sum((number(k) + 2 * number(v)) % 1 for k, v in value.items())
    if isinstance(value, list | tuple | collections.deque):
        return kind + sum((i + 1) * number(item) for i, item in enumerate(value))
    if isinstance(value, set | frozenset):
        return kind + sum(number(item) for item in value)
    if _ours(value):  # a function of this vocabulary: what it computes
        return kind + value(0.5)
    if callable(value):
        return kind + _crc(getattr(value, "__qualname__", ""))
    fields = vars(value) if hasattr(value, "__dict__") else {}
    return kind + sum((number(k) + 2 * number(v)) % 1 for k, v in fields.items())


def _ours(value: Any) -> bool:
    """Whether `value` is `scaled` partially applied, a `closure`, or a `Holder`'s method."""
    if isinstance(value, functools.partial):
        return value.func is scaled
    if isinstance(value, types.MethodType):
        return isinstance(value.__self__, Holder)
    return isinstance(value, types.FunctionType) and value.__module__ == __name__


def attributes(node: Any) -> dict[str, Any]:
    """A graph node's attributes by name, flax's bookkeeping left out; one that holds data
    in a pytree (an optimizer's `opt_state`) as one entry per leaf (`opt_state[0].mu`)."""
    out: dict[str, Any] = {}
    for name, value in vars(node).items():
        if name.startswith("_pytree__"):
            continue
        leaves = _data_leaves(value) if not is_graph_leaf(value) else []
        out.update({name + keys: leaf for keys, leaf in leaves} if leaves else {name: value})
    return out


def _data_leaves(value: Any) -> list[tuple[str, Any]]:
    """`(key path, leaf)` of a pytree holding graph nodes or arrays; [] for a static value."""
    try:
        leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_graph_leaf)[0]
    except Exception:  # keys that do not sort: not a pytree flax flattens
        return []
    data = [(jax.tree_util.keystr(keys), leaf) for keys, leaf in leaves]
    return data if any(is_graph_leaf(x) or isinstance(x, jax.Array) for _, x in data) else []


def _as_number_array(value: Any) -> jax.Array:
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(value)
    return value


def probe(args: Any) -> dict[str, jax.Array]:
    """Everything in `args` as arrays by path: Variables' and arrays' values, static
    values as numbers (`jnp.asarray`, so Python types become dtypes), and a graph node
    met again as -1 (so sharing shows)."""
    out: dict[str, jax.Array] = {}
    seen: set[int] = set()

    def visit(x: Any, path: str) -> None:
        if is_graph_leaf(x):
            if id(x) in seen:
                out[path] = jnp.asarray(-1.0)
                return
            seen.add(id(x))
            if isinstance(x, nnx.Variable):
                kind = 1 + _crc(type(x).__name__)
                if hasattr(x.get_raw_value(), "dtype"):
                    out[path] = _as_number_array(x[...]) * kind
                    return
                for keys, leaf in jax.tree_util.tree_flatten_with_path(x.get_value())[0]:
                    out[path + jax.tree_util.keystr(keys)] = jnp.asarray(leaf) * kind
                return
            for name, value in sorted(attributes(x).items()):  # flax may reorder them
                visit(value, f"{path}.{name}")
        elif isinstance(x, jax.Array | np.ndarray):  # flax keeps NumPy arrays as data too
            out[path] = jnp.asarray(x)
        elif isinstance(x, dict) and path.count(".") == 0:  # an argument's own dict
            for key, value in x.items():
                visit(value, f"{path}.{key}")
        elif isinstance(x, tuple | list) and path.count(".") == 0:
            for i, value in enumerate(x):
                visit(value, f"{path}.{i}")
        elif isinstance(x, bool | int | float):  # its type as the dtype
            out[path] = jnp.asarray(x)
        else:
            out[path] = jnp.asarray(number(x))

    for i, arg in enumerate(args):
        visit(arg, str(i))
    return {path.lstrip("."): value for path, value in out.items()}


# -- finding ------------------------------------------------------------------------------


def _nodes(args: tuple) -> list[Any]:
    leaves = jax.tree.leaves(args, is_leaf=is_graph_leaf)
    return [n for n in leaves if is_graph_leaf(n) and not isinstance(n, nnx.Variable)]


def node(args: tuple, index: int) -> Any:
    """The `index`-th graph node among the arguments (flattened in order), or None."""
    nodes = _nodes(args)
    return nodes[index] if index < len(nodes) else None


def at(root: Any, path: str) -> Any:
    """The graph node at `path` below `root`, or `root` itself where there is none (an
    operation may have removed it): an argument that always exists."""
    found = _get(root, path)
    return found if is_graph_leaf(found) and not isinstance(found, nnx.Variable) else root


def _parent(root: Any, path: str) -> tuple[Any, str] | None:
    """`(object holding the last name of path, that name)` below `root`, or None."""
    *parents, name = path.split(".")
    for part in parents:
        if root is None or not hasattr(root, part):
            return None
        root = getattr(root, part)
    return (root, name) if root is not None and is_graph_leaf(root) else None


def _target(where: Any, path: str) -> tuple[Any, str] | None:
    """The parent and name that `path` names below the node `where` (None: nothing)."""
    return None if where is None else _parent(where, path)


def _get(where: Any, path: str) -> Any:
    return None if (found := _target(where, path)) is None else getattr(*found, None)


def _is_data(value: Any) -> bool:
    return is_graph_leaf(value) or isinstance(value, jax.Array | np.ndarray)


def _assign(parent: Any, name: str, value: Any) -> None:
    """`setattr`, unless flax would refuse it: data where a static value was, or back."""
    if not hasattr(parent, name) or _is_data(getattr(parent, name)) == _is_data(value):
        setattr(parent, name, value)


# -- operations: each does nothing where its target is missing ------------------------------


def transformation(name: str) -> optax.GradientTransformation:
    """The ecosystem corpus's optax object `name`: an optimizer (`"adamw"`), adamw with a
    schedule (`"adamw+cosine_decay_schedule"`) or a wrapper (`"MultiSteps"`)."""
    from meshlift.testing.corpus.objects import TRANSFORMATIONS

    return TRANSFORMATIONS[name]()


def learn(args: tuple) -> None:
    """A step of the first optimizer among the arguments on the first module: the gradient
    of the sum of the module's Params."""
    nodes = _nodes(args)
    optimizer = next((n for n in nodes if isinstance(n, nnx.Optimizer)), None)
    model = next((n for n in nodes if isinstance(n, Box)), None)
    if optimizer is not None and model is not None:
        total = lambda m: sum(jnp.sum(p) for p in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
        optimizer.update(model, nnx.grad(total)(model))


def bump(where: Any, path: str, by: float) -> None:
    """A new value for a Variable: `v[...] = v[...] * 0.5 + by`."""
    _bump(_get(where, path), by)


def bump_params(where: Any, by: float) -> None:
    """`bump` every Param under a node, chosen by type as `wrt=nnx.Param` chooses: a
    Variable made another type in place is left alone."""
    if where is not None:
        for _, value in nnx.iter_graph(where):
            if isinstance(value, nnx.Param):
                _bump(value, by)


def _bump(variable: Any, by: float) -> None:
    if not isinstance(variable, nnx.Variable):
        return
    if hasattr(variable.get_raw_value(), "dtype"):
        value = variable[...]
        if jnp.issubdtype(value.dtype, jnp.inexact):
            variable[...] = value * 0.5 + by
        elif jnp.issubdtype(value.dtype, jnp.integer):
            variable[...] = value + 1
    else:  # a Variable holding a pytree: each of its arrays
        variable.set_value(jax.tree.map(lambda x: x * 0.5 + by, variable.get_value()))


def swap(where: Any, path: str, other: str) -> None:
    """Exchange two attributes of one node."""
    first, second = _target(where, path), _target(where, other)
    if first is None or second is None or first[0] is not second[0]:
        return
    parent = first[0]
    if hasattr(parent, first[1]) and hasattr(parent, second[1]):
        a, b = getattr(parent, first[1]), getattr(parent, second[1])
        if _is_data(a) == _is_data(b):
            setattr(parent, first[1], b)
            setattr(parent, second[1], a)


def alias(where: Any, path: str, other: str) -> None:
    """Point `path` at the object `other` holds."""
    found, value = _target(where, path), _get(where, other)
    if found is not None and value is not None:
        _assign(found[0], found[1], value)


def replace(where: Any, path: str, seed: float) -> None:
    """A new object in place of a Variable (same type and shape) or a submodule."""
    found, old = _target(where, path), _get(where, path)
    if found is None or old is None:
        return
    new: Any
    if isinstance(old, nnx.Variable) and hasattr(old.get_raw_value(), "shape"):
        value = old.get_raw_value()
        new = type(old)(grid(value.shape, seed, value.dtype))
    elif isinstance(old, nnx.Variable):  # a pytree: the same structure, new arrays
        new = type(old)(jax.tree.map(lambda x: grid(x.shape, seed, x.dtype), old.get_value()))
    elif isinstance(old, Box):
        new = Box(w0=nnx.Param(grid((2, 8), seed)))
    else:
        return
    _assign(found[0], found[1], new)


def add(where: Any, path: str, seed: float) -> None:
    """A new attribute: a Param."""
    found = _target(where, path)
    if found is not None and not hasattr(found[0], found[1]):
        setattr(found[0], found[1], nnx.Param(grid((8,), seed)))


def delete(where: Any, path: str) -> None:
    found = _target(where, path)
    if found is not None and hasattr(found[0], found[1]):
        delattr(found[0], found[1])


def touch(where: Any, path: str, when: bool = True) -> None:
    """Change a static value in place, whatever its kind (only `when`)."""
    value = _get(where, path)
    if value is None or not when:
        return
    if isinstance(value, Config | Holder | Key | types.SimpleNamespace):
        value.scale += 1
    elif isinstance(value, list | collections.deque):
        value.append(3.0)
    elif isinstance(value, types.MappingProxyType):
        items = _backing(value)
        items["scale"] = items.get("scale", 0) + 1
    elif isinstance(value, dict) and any(isinstance(key, Key) for key in value):
        for key in value:  # (flax sorts a dict's keys: no string key beside them)
            key.scale += 1
    elif isinstance(value, dict):
        value["scale"] = value.get("scale", 0) + 1
    elif isinstance(value, set):
        value.add(len(value) + 7)
    elif isinstance(value, bytearray | memoryview):
        value[0] ^= 1
    elif isinstance(value, array.array):
        value[0] += 1
    elif isinstance(value, functools.partial):
        value.keywords["offset"] = value.keywords.get("offset", 0.0) + 1
    elif isinstance(value, types.MethodType | types.FunctionType):
        holder: Any = value.__self__ if isinstance(value, types.MethodType) else None
        if holder is None and value.__closure__:
            holder = value.__closure__[0].cell_contents  # a closure's Config
        if holder is not None:
            holder.scale += 1


_OTHER_CLASS = {Config: OtherConfig, OtherConfig: Config, Holder: OtherHolder, OtherHolder: Holder}


def swap_class(where: Any, path: str) -> None:
    """Change an object's type in place (`__class__`), its fields unchanged: a `Config`,
    a `Holder`, or the `Holder` of a bound method."""
    value = _get(where, path)
    value = value.__self__ if isinstance(value, types.MethodType) else value
    if type(value) in _OTHER_CLASS:
        value.__class__ = _OTHER_CLASS[type(value)]


def swap_dict(where: Any, path: str) -> None:
    """Give an object a new attribute dict (`obj.__dict__ = {...}`), one field changed."""
    value = _get(where, path)
    if isinstance(value, Config | Holder | Box) and not isinstance(value, nnx.Variable):
        fields = dict(vars(value))
        fields["scale"] = 9.0 if not isinstance(value, Box) else 4.0
        object.__setattr__(value, "__dict__", fields)


def setattr_if(where: Any, path: str, value: Any) -> None:
    """Set an attribute (a static value, say) where its parent exists."""
    found = _target(where, path)
    if found is not None:
        _assign(found[0], found[1], value)


def reshape(where: Any, path: str) -> None:
    """A new value of another shape for a Variable (its first dimension doubled)."""
    variable = _get(where, path)
    if isinstance(variable, nnx.Variable) and isinstance(variable.get_raw_value(), jax.Array):
        value = variable.get_raw_value()
        variable.set_value(jnp.concatenate([value, value + 1]))


def restructure(where: Any, path: str, seed: float) -> None:
    """Give a Variable a value of another pytree structure: an array becomes `{"a": it}`
    and `{"a": it}` the array again; another dict gains the key `"c"` or, having it,
    loses it."""
    variable = _get(where, path)
    if not isinstance(variable, nnx.Variable) or compat.is_ref(variable.get_raw_value()):
        return
    value = variable.get_value()
    if not isinstance(value, dict):
        variable.set_value({"a": value})
    elif list(value) == ["a"]:
        variable.set_value(value["a"])
    elif "c" in value:
        variable.set_value({k: v for k, v in value.items() if k != "c"})
    else:
        variable.set_value({**value, "c": grid((8,), seed)})


def retype(where: Any, path: str, to: type) -> None:
    """Change a Variable's type in place: `v.__class__ = to`."""
    variable = _get(where, path)
    if isinstance(variable, nnx.Variable) and type(variable) is not to:
        variable.__class__ = to


def remeta(where: Any, path: str, tag: str) -> None:
    """Set a metadata entry on a Variable."""
    variable = _get(where, path)
    if isinstance(variable, nnx.Variable):
        variable.set_metadata(tag=tag)


def mode(where: Any, train: bool) -> None:
    """`train()` or `eval()` on a node: flax sets its layers' flags."""
    if isinstance(where, nnx.Module):
        where.train() if train else where.eval()


def layers(where: Any) -> None:
    """Run every BatchNorm, Dropout and Linear directly under a node on a fixed input."""
    if where is None:
        return
    for value in list(attributes(where).values()):
        if isinstance(value, nnx.BatchNorm | nnx.Dropout):
            value(grid((2, 8), 0.25))
        elif isinstance(value, nnx.Linear):
            value(grid((2, value.in_features), 0.25))
