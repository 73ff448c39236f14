"""Sharding plans: `StateSharding`, path filters, and spec validation.

A plan maps each parameter of a model to a `PartitionSpec`. Write it once:

```python
from jax.sharding import PartitionSpec as P
import meshlift as ml

plan = ml.StateSharding({
    ml.path_endswith("linear1", "kernel"): P(None, "model"),
    ml.path_endswith("linear2", "kernel"): P("model", None),
    ...: P(),                        # everything else replicated
})
```

and pass it wherever a transform takes shardings or specs, at the position of
the module it describes (`in_shardings=(plan, P("data"))`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeAlias

from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec, Sharding

from meshlift.errors import PlanError
from meshlift.paths import Path, format_path
from meshlift.plans.annotation import annotated_leaves, unused_rules_of
from meshlift.plans.logical import Rules, report_skipped

Spec: TypeAlias = PartitionSpec | Sharding | None


class path_endswith:
    """Filter matching parameters whose path ends with `parts`.

    Called as a filter, `path_endswith(*parts)(path, value)` is True where the
    last `len(parts)` entries of `path`, as strings, equal `parts`.

    Args:
        *parts: The last entries of a path (`"linear1", "kernel"`); compared as strings.

    Raises:
        TypeError: If no part is given.

    Example:

    ```python
    plan = ml.StateSharding({ml.path_endswith("linear1", "kernel"): P(None, "model"), ...: P()})
    ```
    """

    def __init__(self, *parts: Hashable) -> None:
        if not parts:
            raise TypeError(
                "path_endswith needs at least one path part, e.g. path_endswith('kernel')"
            )
        self.parts = tuple(str(p) for p in parts)

    def __call__(self, path: Path, value: Any = None) -> bool:
        n = len(self.parts)
        return len(path) >= n and tuple(str(p) for p in path[-n:]) == self.parts

    def __repr__(self) -> str:
        return f"path_endswith({', '.join(map(repr, self.parts))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, path_endswith) and other.parts == self.parts

    def __hash__(self) -> int:
        return hash((path_endswith, self.parts))


class _PathPrefix:
    """Matches paths that start with `prefix` (how a nested mapping of specs broadcasts)."""

    def __init__(self, prefix: Path):
        self.prefix = tuple(str(p) for p in prefix)

    def __call__(self, path: Path, value: Any = None) -> bool:
        return tuple(str(p) for p in path[: len(self.prefix)]) == self.prefix

    def __repr__(self) -> str:
        return f"path {format_path(self.prefix)!r}"


class _AnnotatedPath(path_endswith):
    """The path of an annotated parameter, with or without the `value` field of its box.

    A linen `Partitioned` box is a pytree node: transforms see its array at
    `params.Dense_0.kernel.value`, `ml.unbox` at `params.Dense_0.kernel`.
    """

    def __call__(self, path: Path, value: Any = None) -> bool:
        if super().__call__(path, value):
            return True
        return bool(path) and str(path[-1]) == "value" and super().__call__(path[:-1], value)

    def __repr__(self) -> str:
        return f"annotation {format_path(self.parts)!r}"


def is_spec(x: Any) -> bool:
    """True for what can stand at a leaf of a sharding prefix tree."""
    return x is None or isinstance(x, PartitionSpec | Sharding | StateSharding | nnx.StateSharding)


def as_plan(x: Any) -> Any:
    """flax's `nnx.StateSharding` as meshlift's `StateSharding` (the same ordered filter ->
    sharding pairs); anything else as it is."""
    return StateSharding(x) if isinstance(x, nnx.StateSharding) else x


def _shaped_like_a_model(rules: Any) -> bool:
    """An `nnx.State`, or a mapping with a mapping among its values: specs by path."""
    if isinstance(rules, nnx.State):
        return True
    return (
        isinstance(rules, Mapping)
        and not isinstance(rules, StateSharding)
        and any(isinstance(v, Mapping) for v in rules.values())
    )


def _path_rules(specs: Mapping[Any, Any]) -> list[tuple[Any, Spec]]:
    """`(path prefix filter, spec)` pairs of a nested mapping of specs, deepest first."""
    flat: list[tuple[Path, Spec]] = []

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, Mapping) and not isinstance(node, StateSharding):
            for key, child in node.items():
                walk(child, (*path, key))
        else:
            value = node.get_raw_value() if isinstance(node, nnx.Variable) else node
            flat.append((path, value))

    walk(specs, ())
    flat.sort(key=lambda item: -len(item[0]))
    return [(_PathPrefix(path), spec) for path, spec in flat]


class StateSharding:
    """Ordered `filter -> spec` pairs; the first filter that matches a parameter wins.

    Filters are NNX filters (a `Variable` type such as `nnx.Param`, a tag
    string, a `(path, variable) -> bool` predicate, `nnx.All`/`Any`/`Not`),
    `ml.path_endswith(...)`, or `...` for everything. Specs are
    `PartitionSpec`, `NamedSharding` or `None` (left to the compiler).
    flax's `nnx.StateSharding` is taken wherever this is (`in_shardings`,
    `in_specs`, `ml.explain`), as `nnx.jit` takes it; `StateSharding(flax_plan)`
    converts one.

    Example:

    ```python
    plan = ml.StateSharding({
        nnx.BatchStat: P(),
        ml.path_endswith("kernel"): P(None, "model"),
        ...: P(),
    })
    linear1 = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    assert plan.spec_for(("linear1", "kernel"), linear1.kernel) == P(None, "model")
    ```

    A parameter that no filter matches is an error naming its path: end the
    plan with `...: P()` to replicate the rest.

    Args:
        rules: `{filter: spec}`, `(filter, spec)` pairs in order, flax's
            `nnx.StateSharding`, or an `nnx.State` / nested mapping of specs shaped like
            the model.

    Attributes:
        rules: `(filter, predicate, spec)` for each rule, in order.

    Raises:
        TypeError: If a spec is not a `PartitionSpec`, a `NamedSharding` or None.
    """

    def __init__(
        self, rules: Mapping[Any, Any] | Iterable[tuple[Any, Spec]] | nnx.StateSharding
    ) -> None:
        if isinstance(rules, nnx.StateSharding):  # flax's own object: the same pairs
            rules = zip(rules.filters, rules.shardings, strict=True)
        elif _shaped_like_a_model(rules):  # flax's StateSharding(nnx.State({...specs...}))
            rules = _path_rules(rules)  # type: ignore[arg-type]
        pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        self.rules: tuple[tuple[Any, Callable[..., bool], Spec], ...] = tuple(
            (filter_, nnx.filterlib.to_predicate(filter_), _check_spec_type(spec, filter_))
            for filter_, spec in pairs
        )
        self.root: Path = ()  # where the parameters asked about sit below the plan's object
        self.origin = self  # the plan as written (`below` gives views of it)

    @property
    def names_paths(self) -> bool:
        """Whether every filter (but `...`) is a path of the object the plan was made from
        (`from_metadata`, `from_state`, `ml.get_sharding`'s output), not a predicate."""
        filters = [f for f, _, _ in self.rules if f is not ...]
        return bool(filters) and all(isinstance(f, _PathPrefix | _AnnotatedPath) for f in filters)

    def below(self, keys: Path) -> StateSharding:
        """This plan for what sits at `keys` below the object it is given for: a path asked
        about is read from that object (`("params", "l", "kernel")` for the Variable at
        `state.params.l.kernel` when the plan is given for `state`), as a plan made from
        that object (`from_metadata`, `ml.get_sharding`) names its parameters.

        Example:

        ```python
        plan = ml.StateSharding.from_state({"params": {"kernel": P(None, "model")}})
        kernel = nnx.Param(jnp.ones((2, 8)))
        assert plan.below(("params", "kernel")).spec_for((), kernel) == P(None, "model")
        ```
        """
        if not keys:
            return self
        view = object.__new__(StateSharding)
        view.rules, view.root, view.origin = self.rules, (*self.root, *keys), self.origin
        return view

    @classmethod
    def from_state(cls, specs: Mapping[Any, Any]) -> StateSharding:
        """A plan from an `nnx.State` or nested mapping of specs, shaped like the model.

        A spec at an inner node applies to every parameter below it; deeper entries win.
        `StateSharding(specs)` does the same for an `nnx.State` or a nested mapping
        (as flax's `nnx.StateSharding(state)`); `from_state` also takes a flat one.

        Args:
            specs: An `nnx.State` or mapping of specs, nested like the model.

        Returns:
            The plan, one rule per entry, the deepest first.

        Raises:
            TypeError: If a leaf is not a `PartitionSpec`, a `NamedSharding` or None.

        Example:

        ```python
        plan = ml.StateSharding.from_state({"linear1": {"kernel": P(None, "model"),
                                                        "bias": P("model")},
                                            "linear2": P()})
        ```
        """
        return cls(_path_rules(specs))

    @classmethod
    def from_metadata(
        cls,
        model_or_tree: Any,
        rules: Rules | None = None,
        *,
        mesh: Mesh | AbstractMesh | None = None,
        strict: bool = False,
    ) -> StateSharding:
        """The plan written in the model's own annotations, usable by every backend.

        Reads NNX `out_sharding` metadata and linen `Partitioned` boxes (from
        `ml.with_partitioning` or flax's functions) of a module, `nnx.State`,
        variable dict, `TrainState` or `jax.eval_shape` output. Names mean what
        the library that wrote them means (`ml.with_partitioning`). Logical
        names are mapped by the parameter's own rules, then by `rules` (by
        default those of `ml.axis_rules` / `nnx.logical_axis_rules`). With
        `mesh` (a Mesh or `{"data": 2, ...}`), a rule for axes the mesh lacks
        is skipped and an `ml.AxisRuleWarning` names it and the parameters
        (with `strict=True`, a PlanError); so is a rule whose logical name no
        parameter has while a name close to it has no rule (a typo: `"mpl"`
        for `"mlp"`). Each parameter matches by the end of
        its path, so the plan of a model also shards its optimizer state;
        unannotated arrays are replicated.

        Args:
            model_or_tree: A module, `nnx.State`, variable dict, `TrainState` or
                abstract tree holding the annotations.
            rules: Logical axis rules; None: those in context.
            mesh: A mesh (or `{"data": 2, ...}`) to check the rules' axes against;
                None: no check.
            strict: Make a rule skipped for an axis the mesh lacks, or one that
                does nothing for a typo, a `PlanError` instead of an `ml.AxisRuleWarning`.

        Returns:
            A plan with one rule per annotated parameter, the most specific path
                first, then `...: P()`.

        Raises:
            meshlift.PlanError: If a parameter has logical names and no rules are set,
                or, with `strict=True`, a rule is skipped.
            TypeError: If `rules` are malformed.
            ValueError: If a rule repeats a mesh axis, or a logical name names two
                dimensions of one array.

        Example:

        ```python
        import optax

        init = ml.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        model = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        mesh = ml.make_mesh({"data": 2, "model": 4})

        def train_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(batch) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        plan = ml.StateSharding.from_metadata(model)
        step = ml.jit(train_step, in_shardings=(plan, plan, P("data")), mesh=mesh)
        loss = step(model, optimizer, jnp.ones((8, 16)))
        ```
        """
        pairs = []
        items = annotated_leaves(model_or_tree)
        skipped_for: dict[Any, list[str]] = {**unused_rules_of(items, rules, mesh)[0]}
        seen: set[Path] = set()  # a Variable holding a pytree is met at each of its arrays
        for item in items:
            if item.names is None or not item.path or item.path in seen:
                continue
            seen.add(item.path)
            spec, skipped = item.resolve(rules, mesh)
            pairs.append((_AnnotatedPath(*item.path), spec))
            for rule in skipped:
                skipped_for.setdefault(rule, []).append(f"`{format_path(item.path)}`")
        report_skipped(skipped_for, strict=strict)
        pairs.sort(key=lambda pair: -len(pair[0].parts))  # the most specific path first
        return cls([*pairs, (..., PartitionSpec())])

    def spec_for(self, path: Path, value: Any) -> Spec:
        """The spec of the first rule matching `(path, value)`; a PlanError if none does.

        Args:
            path: The parameter's path, a tuple of keys (`("linear1", "kernel")`).
            value: The parameter (a Variable or an array), for type filters.

        Returns:
            The rule's `PartitionSpec`, `NamedSharding` or None.

        Raises:
            meshlift.PlanError: If no filter matches.
        """
        return self.rules[self.rule_for(path, value)][2]

    def rule_for(self, path: Path, value: Any) -> int:
        """The index of the first rule matching `(path, value)`; a PlanError if none does.

        Args:
            path: The parameter's path, a tuple of keys.
            value: The parameter (a Variable or an array), for type filters.

        Returns:
            The index into `rules`.

        Raises:
            meshlift.PlanError: If no filter matches.
        """
        path = (*self.root, *path)
        for i, (_, predicate, _) in enumerate(self.rules):
            if predicate(path, value):
                return i
        hint = ""
        if any(isinstance(f, str) for f, _, _ in self.rules):
            hint = (
                " A string filter matches a Variable's tag, not its name: to give specs "
                "by path, nest them like the model ({'linear1': {'kernel': P(...)}}) or "
                "use StateSharding.from_state."
            )
        raise PlanError(
            f"no filter of the plan matches `{format_path(path)}` "
            f"({type(value).__name__}, shape {value_shape(value)}); the plan's filters are "
            f"{[f for f, _, _ in self.rules]}. Add a rule for it, or end the plan with "
            f"`...: P()` to replicate everything not listed.{hint}"
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{f!r}: {s!r}" for f, _, s in self.rules)
        return f"StateSharding({{{inner}}})"


def _check_spec_type(spec: Any, filter_: Any) -> Spec:
    if spec is None or isinstance(spec, PartitionSpec | Sharding):
        return spec
    if isinstance(spec, list | tuple) and all(
        p is None or isinstance(p, str | tuple) for p in spec
    ):
        raise TypeError(
            f"the spec for filter {filter_!r} is a {type(spec).__name__} {spec!r}; "
            f"wrap it: PartitionSpec{tuple(spec)!r}"
        )
    raise TypeError(
        f"the spec for filter {filter_!r} must be a PartitionSpec, NamedSharding or None, "
        f"got {type(spec).__name__}: {spec!r}"
    )


def value_shape(value: Any) -> tuple[int, ...]:
    """The shape of an array, a Variable's array, or `()` for a Python scalar."""
    if isinstance(value, nnx.Variable):
        value = value.get_raw_value()
    return tuple(getattr(value, "shape", ()))


def is_path_filter(filter_: Any) -> bool:
    """Whether `filter_` names a path (`path_endswith`, a path of a plan made from an object),
    so that matching nothing is likely a typo; a type, a tag or a predicate may match nothing
    in one call and something in another."""
    return isinstance(filter_, path_endswith | _PathPrefix)
