"""Arguments: a lifted function's signature, its static and donated arguments, and leaf paths.

`Signature` applies `jax.jit`'s rules for `static_argnums`/`static_argnames`
and `donate_argnums`/`donate_argnames` (refusing, when it is made, what
`jax.jit` refuses, with `jax.jit`'s own error), and names every argument
leaf by the caller's parameter names (`("batch", "x")`), so errors speak
the user's language. Static arguments are compiled in by type and value, as
`jax.jit` keys them: `1`, `True` and `1.0` are three programs.

Example:

```python
from meshlift.call.arguments import Signature, static_key

def step(model, batch, lr):
    ...

sig = Signature(step, static_argnums=2)
args, kwargs, statics = sig.pop_statics((1, {"x": 2}, 0.1), {})
assert statics == ((2, 0.1),) and sig.leaf_paths(args, kwargs, statics)[0] == ("model",)
assert static_key(((0, 1),)) != static_key(((0, True),))
```
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import jax

from meshlift import compat
from meshlift.errors import PlanError
from meshlift.graph.split import is_graph_leaf
from meshlift.paths import Path, key_name


class Signature:
    """Parameter names and the static and donated argument positions of a function."""

    def __init__(
        self,
        fun: Callable[..., Any],
        static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
    ):
        jitted = _refuse_as_jit_does(
            fun, static_argnums, static_argnames, donate_argnums, donate_argnames
        )
        self.names = _parameter_names(fun)
        resolved = compat.jit_argnums(jitted) or (
            *_infer(self.names, static_argnums, static_argnames),
            *_infer(self.names, donate_argnums, donate_argnames),
        )
        self.static_argnums, self.static_argnames = resolved[0], resolved[1]
        self.donate_argnums, self.donate_argnames = resolved[2], resolved[3]

    def pop_statics(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[tuple[int | str, Any], ...]]:
        """The dynamic arguments, and `((position or name, value), ...)` of the static ones."""
        if not (self.static_argnums or self.static_argnames):
            return args, kwargs, ()
        for i in self.static_argnums:
            if i < -len(args):  # jax.jit's words; a number past the end is ignored
                raise ValueError(
                    "Positional argument indices, e.g. for `static_argnums`, must have value "
                    "greater than or equal to -len(args) and less than len(args), but got "
                    f"value {i} for len(args) == {len(args)}."
                )
        nums = {i % len(args) for i in self.static_argnums if i < len(args)}
        statics: tuple[tuple[int | str, Any], ...] = tuple((i, args[i]) for i in sorted(nums))
        statics += tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs)
        for where, value in statics:
            try:
                hash(value)
            except TypeError as e:  # jax.jit raises a ValueError
                raise ValueError(
                    f"Non-hashable static arguments are not supported: static argument "
                    f"{self.name(where)} must be hashable, got {type(value).__name__}: "
                    f"{value!r}; pass a tuple or a frozen dataclass, or don't mark it static"
                ) from e
        args = tuple(a for i, a in enumerate(args) if i not in nums)
        kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return args, kwargs, statics

    def name(self, where: int | str) -> str:
        """The caller's name for a positional index or keyword."""
        if isinstance(where, str):
            return where
        if where < len(self.names):
            return self.names[where]
        return f"args[{where}]"

    def leaf_paths(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], statics: tuple[Any, ...]
    ) -> list[Path]:
        """A path per leaf (graph nodes are leaves): `("model",)`, `("batch", "x")`."""
        return [(self.name(where), *rest) for where, rest in _leaf_arguments(args, kwargs, statics)]

    def donated_leaves(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], statics: tuple[Any, ...]
    ) -> list[bool]:
        """Whether each leaf belongs to a donated argument: a positional one by its position
        (a negative one donates nothing, as in jax.jit), a keyword one by its name."""
        nums, names = set(self.donate_argnums), set(self.donate_argnames)
        return [
            where in nums if isinstance(where, int) else where in names
            for where, _ in _leaf_arguments(args, kwargs, statics)
        ]

    def positional_prefix(
        self,
        specs: Any,
        args: tuple[Any, ...],
        what: str,
        fun_name: str,
    ) -> Any:
        """`specs` as a prefix of the non-static positional arguments."""
        if not isinstance(specs, tuple | list):
            return specs
        specs = tuple(specs)
        if len(specs) == len(args):
            return specs
        n_static = len([n for n in self.static_argnums if n >= 0])
        if n_static and len(specs) == len(args) + n_static:
            return tuple(s for i, s in enumerate(specs) if i not in self.static_argnums)
        raise PlanError(
            f"{what} has {len(specs)} entries but {fun_name} was called with {len(args)} "
            f"positional arguments (not counting static ones); give one spec per argument, or "
            f"a single spec for all"
        )


def static_key(statics: tuple[Any, ...]) -> tuple[Any, ...]:
    """What static arguments are compiled in as: each one's place, type and value."""
    return tuple((where, type(value), value) for where, value in statics)


def _leaf_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], statics: tuple[Any, ...]
) -> list[tuple[int | str, Path]]:
    """Per leaf, in the order JAX flattens `(args, kwargs)`: the caller's position or
    keyword of its argument, and its path inside that argument."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_graph_leaf)
    out: list[tuple[int | str, Path]] = []
    for keypath, _ in with_paths:
        which, first, *rest = keypath
        where: int | str = key_name(first)
        if key_name(which) == "0":
            where = original_index(int(where), statics)
        out.append((where, tuple(map(key_name, rest))))
    return out


def _refuse_as_jit_does(fun: Callable[..., Any], *options: Any) -> Any:
    """Raise `jax.jit`'s own error for options it refuses (an argnum out of range, an
    unknown argname, one argument both static and donated...): `jax.jit` checks them
    when it wraps `fun`, so wrapping it is the check. Returns the wrapped function."""
    static_argnums, static_argnames, donate_argnums, donate_argnames = options
    return jax.jit(
        fun,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
    )


def insert_statics(args: tuple[Any, ...], statics: tuple[Any, ...]) -> list[Any]:
    """The positional arguments with the static ones put back in place."""
    out = list(args)
    for where, value in statics:
        if isinstance(where, int):
            out.insert(where, value)
    return out


def named_statics(statics: tuple[Any, ...]) -> dict[str, Any]:
    return {where: value for where, value in statics if isinstance(where, str)}


def original_index(j: int, statics: tuple[Any, ...]) -> int:
    """The caller's position of the j-th non-static positional argument."""
    i = j
    for s in sorted(where for where, _ in statics if isinstance(where, int)):
        if s <= i:
            i += 1
    return i


def _parameter_names(fun: Callable[..., Any]) -> list[str]:
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def _infer(
    names: list[str], argnums: int | Iterable[int] | None, argnames: str | Iterable[str] | None
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """jax.jit's rule: given only numbers, infer the names from the signature, and back."""
    nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
    strs = () if argnames is None else (argnames,) if isinstance(argnames, str) else tuple(argnames)
    if argnums is not None and argnames is None:  # non-negative numbers only, as jax.jit
        strs = tuple(names[i] for i in nums if 0 <= i < len(names))
    elif argnames is not None and argnums is None:
        nums = tuple(names.index(n) for n in strs if n in names)
    return nums, strs
