"""The lift options: what every lifted transform takes beside its function, specs and mesh.

Defined here once. `ml.transform` and each front end (`ml.jit`,
`ml.shard_map`, `ml.pjit`, a third party's) take them as keywords:
a front end ends its parameters with `**lift` and `takes_lift_options`
gives it these keywords (in its signature, as `help()` shows it) and
refuses any other, as Python would.

Example:

```python
import meshlift as ml

@ml.takes_lift_options
def front_end(fun, /, *, mesh=None, **lift):
    return ml.transform("jit", fun, mesh=mesh, **lift)

step = front_end(lambda x, n: x * n, static_argnums=1)
assert step(2.0, 3) == 6.0
```
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from meshlift.plans.specs import did_you_mean

Function = TypeVar("Function", bound=Callable[..., Any])


def _graph_mode(_: LiftOptions, option: attrs.Attribute[Any], value: Any) -> None:
    """Refuse flax's tree mode (`graph=False`, `graph_updates=False`): meshlift keeps graph
    semantics, and running them where tree semantics were asked would differ silently."""
    name = option.name
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}= takes True, False or None, got {type(value).__name__}")
    if value is False:
        raise ValueError(
            f"{name}=False asks for flax's tree mode, which meshlift does not offer: it "
            f"keeps graph semantics (shared Variables, structure changes carried back to "
            f"your objects). Drop {name}= (or pass True), or use flax's nnx.jit for tree mode"
        )


@attrs.frozen(kw_only=True)
class LiftOptions:
    """The options of every lifted transform, as `jax.jit` and `nnx.jit` name them.

    Attributes:
        static_argnums: Positions of static arguments, as in `jax.jit`.
        static_argnames: Names of static arguments, as in `jax.jit`.
        donate_argnums: Positions of donated arguments, as in `jax.jit`.
        donate_argnames: Names of donated arguments, as in `jax.jit`.
        graph: `nnx.jit`'s: True or None (graph semantics, what meshlift does);
            False, flax's tree mode, is refused.
        graph_updates: `nnx.jit`'s: True or None (updates carried back); False is
            refused.

    Example: `ml.LiftOptions(static_argnames="n").argnums == (None, "n", None, None)`.
    """

    static_argnums: int | Iterable[int] | None = None
    static_argnames: str | Iterable[str] | None = None
    donate_argnums: int | Iterable[int] | None = None
    donate_argnames: str | Iterable[str] | None = None
    graph: bool | None = attrs.field(default=None, validator=_graph_mode)
    graph_updates: bool | None = attrs.field(default=None, validator=_graph_mode)

    @property
    def argnums(self) -> tuple[Any, Any, Any, Any]:
        """(static_argnums, static_argnames, donate_argnums, donate_argnames), as given."""
        return self.static_argnums, self.static_argnames, self.donate_argnums, self.donate_argnames

    @classmethod
    def split(cls, keywords: Mapping[str, Any]) -> tuple[LiftOptions, dict[str, Any]]:
        """The lift options among `keywords`, and the other keywords (a backend's options)."""
        names = attrs.fields_dict(cls)
        lift = cls(**{name: value for name, value in keywords.items() if name in names})
        return lift, {name: value for name, value in keywords.items() if name not in names}


def _parameters() -> list[inspect.Parameter]:
    """The lift options as keyword-only parameters, annotated as `LiftOptions` declares."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(option.name, keyword, default=option.default, annotation=option.type)
        for option in attrs.fields(LiftOptions)
    ]


def takes_lift_options(front_end: Function) -> Function:
    """Give `front_end`, whose parameters end in `**lift`, the lift options as keywords.

    Its signature (`inspect.signature`, `help()`) lists them where `**lift`
    stood, after any it names itself (old `pjit`'s positional
    `static_argnums`); any other keyword is refused with Python's TypeError.
    `ml.transform`, whose `**options` also carries a backend's options,
    keeps its `**options` after them.

    Example: `ml.jit` is `takes_lift_options(def jit(fun=None, /, *, in_shardings=None, ...,
    mesh=None, **lift))`.
    """
    signature = inspect.signature(front_end)
    *named, rest = signature.parameters.values()
    if rest.kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{front_end.__qualname__} must end its parameters with **lift")
    added = [p for p in _parameters() if p.name not in signature.parameters]
    parameters = [*named, *added] + ([] if rest.name == "lift" else [rest])
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {p.name for p in parameters if p.kind in by_keyword}
    checks = rest.name == "lift"

    @functools.wraps(front_end)
    def with_lift_options(*args: Any, **keywords: Any) -> Any:
        unknown = [name for name in keywords if name not in accepted] if checks else []
        if unknown:
            raise TypeError(
                f"{front_end.__name__}() got an unexpected keyword argument {unknown[0]!r}; "
                f"{did_you_mean(unknown[0], accepted)}it takes {', '.join(sorted(accepted))}"
            )
        return front_end(*args, **keywords)

    with_lift_options.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return typing.cast(Function, with_lift_options)
