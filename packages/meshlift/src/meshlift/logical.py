"""Logical axis rules: name array dimensions once, map the names to mesh axes in one place.

Rules are an ordered list of `(logical_name, mesh_axes)` pairs. A logical
name may appear several times, as fallbacks. Rules are applied in order: a
rule gives its mesh axes to its dimension if that dimension has none yet, the
axes exist (in the mesh, when a mesh is known) and no other dimension of the
same array already uses them. A name with no rule is replicated, and no spec
ever uses a mesh axis twice (flax's linen semantics; NNX's resolver can
return `P('model', 'model')`).

Example:

```python
import meshlift as ml
from jax.sharding import PartitionSpec as P

rules = [("embed", "data"), ("embed", "model"), ("mlp", "model")]
assert ml.logical_to_mesh(("mlp", "embed"), rules) == P("model", "data")
with ml.axis_rules(rules):
    assert ml.logical_to_mesh(P("embed", "vocab")) == P("data", None)
```
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
from flax.core import spmd as flax_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshlift.mesh import current_mesh

MeshAxes: TypeAlias = str | tuple[str, ...] | None
Rules: TypeAlias = Sequence[tuple[str, MeshAxes]]

_RULES: contextvars.ContextVar[tuple[tuple[str, MeshAxes], ...] | None] = contextvars.ContextVar(
    "meshlift_axis_rules", default=None
)


def check_rules(rules: Any) -> tuple[tuple[str, MeshAxes], ...]:
    """`rules` as a tuple of `(name, mesh_axes)` pairs; a TypeError saying what is wrong."""
    if isinstance(rules, str | Mapping) or not isinstance(rules, Sequence):
        raise TypeError(
            f"axis rules must be a list of (logical_name, mesh_axes) pairs, got "
            f"{type(rules).__name__}: {rules!r}; write [('batch', 'data'), ('hidden', 'model')]"
        )
    out = []
    for rule in rules:
        if not (isinstance(rule, Sequence) and not isinstance(rule, str) and len(rule) == 2):
            raise TypeError(
                f"axis rule {rule!r} is not a (logical_name, mesh_axes) pair; write "
                f"('hidden', 'model'), ('hidden', ('data', 'model')) or ('hidden', None)"
            )
        name, axes = rule
        if isinstance(axes, list):
            axes = tuple(axes)
        if not isinstance(name, str) or not (
            axes is None
            or isinstance(axes, str)
            or (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes))
        ):
            raise TypeError(
                f"axis rule {rule!r}: the logical name must be a string and the mesh axes a "
                f"string, a tuple of strings or None"
            )
        out.append((name, axes))
    return tuple(out)


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[tuple[tuple[str, MeshAxes], ...]]:
    """Set the logical axis rules for the block (flax's `nn.logical_axis_rules` too).

    Example:

    ```python
    init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    abstract_variables = nnx.eval_shape(
        lambda: nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
    )
    with ml.axis_rules([("batch", "data"), ("hidden", "model")]):
        specs = ml.get_partition_spec(abstract_variables)   # logical names resolved
    assert specs["kernel"].get_value() == P(None, "model")
    ```
    """
    checked = check_rules(rules)
    token = _RULES.set(checked)
    try:
        with flax_spmd.logical_axis_rules(checked):  # flax's own helpers see the same rules
            yield checked
    finally:
        _RULES.reset(token)


def current_rules() -> tuple[tuple[str, MeshAxes], ...] | None:
    """The rules of the innermost `ml.axis_rules` block, else None."""
    return _RULES.get()


def _axes_of(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _mesh_axis_names(mesh: Any) -> set[str] | None:
    if mesh is None:
        return None
    if isinstance(mesh, Mapping):
        return set(mesh)
    return set(mesh.axis_names)


def logical_to_mesh_axes(
    names: Sequence[str | None] | PartitionSpec | None,
    rules: Rules | None = None,
    *,
    mesh: Any = None,
) -> PartitionSpec | None:
    """The mesh `PartitionSpec` for one array whose dimensions have logical `names`.

    `rules` default to those of `ml.axis_rules`. With a `mesh` (a Mesh or
    `{"data": 2, ...}`), a rule whose mesh axes the mesh lacks is skipped, so
    a later fallback applies.

    Example:

    ```python
    rules = [("embed", "data"), ("embed", "model"), ("mlp", "model")]
    assert ml.logical_to_mesh_axes(("mlp", "embed"), rules) == P("model", "data")
    ```
    """
    if names is None:
        return None
    rules = _resolve_rules(rules)
    names = tuple(names)
    seen: set[str] = set()
    for name in names:
        if isinstance(name, str):
            if name in seen:
                raise ValueError(
                    f"logical name {name!r} names two dimensions of {names}; each logical name "
                    f"may name one dimension of an array (rename one of them)"
                )
            seen.add(name)
    unassigned = object()
    result: list[Any] = [unassigned if isinstance(n, str) else n for n in names]
    used: set[str] = set()
    available = _mesh_axis_names(mesh)
    for name, axes in rules:
        if name not in seen:
            continue
        dim = names.index(name)
        wanted = _axes_of(axes)
        if result[dim] is not unassigned or used.intersection(wanted):
            continue
        if available is not None and not available.issuperset(wanted):
            continue
        result[dim] = axes
        used.update(wanted)
    return PartitionSpec(*(None if r is unassigned else r for r in result))


def _is_logical_leaf(x: Any) -> bool:
    return (
        x is None
        or isinstance(x, PartitionSpec)
        or (isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x))
    )


def logical_to_mesh(specs: Any, rules: Rules | None = None, *, mesh: Any = None) -> Any:
    """Map logical specs to mesh specs: one spec, or a pytree of them (`P` or name tuples).

    Example:

    ```python
    specs = ml.logical_to_mesh({"w": P("embed", "mlp"), "b": P("mlp")}, [("mlp", "model")])
    assert specs == {"w": P(None, "model"), "b": P("model")}
    ```
    """
    rules = _resolve_rules(rules)
    if _is_logical_leaf(specs):
        return logical_to_mesh_axes(specs, rules, mesh=mesh)
    return jax.tree.map(
        lambda s: logical_to_mesh_axes(s, rules, mesh=mesh), specs, is_leaf=_is_logical_leaf
    )


def logical_to_mesh_sharding(specs: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Like `logical_to_mesh`, giving a `NamedSharding` on `mesh` per spec.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    sharding = ml.logical_to_mesh_sharding(P("batch", "hidden"), mesh, [("batch", "data")])
    assert sharding == jax.NamedSharding(mesh, P("data", None))
    ```
    """
    resolved = logical_to_mesh(specs, rules, mesh=mesh)
    return jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s),
        resolved,
        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
    )


def with_logical_constraint(
    x: Any, names: Any, rules: Rules | None = None, *, mesh: Mesh | None = None
) -> Any:
    """`jax.lax.with_sharding_constraint` with logical dimension names.

    The mesh is `mesh=`, else the one of `ml.use_mesh` (`jax.set_mesh`),
    else the deprecated `with mesh:` context; with none, `x` is returned
    unchanged (one device: nothing to constrain); with no rules at all, too (as in
    flax). A name without a rule is replicated. `x` may be a pytree, with
    `names` a matching tree of name tuples.

    Example:

    ```python
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with ml.use_mesh(mesh), ml.axis_rules([("batch", "data")]):
        y = ml.with_logical_constraint(jnp.ones((8, 16)), ("batch", "embed"))   # P('data', None)
    ```
    """
    mesh = mesh if mesh is not None else current_mesh(legacy=True)
    rules = _resolve_rules(rules)
    if mesh is None or names is None or not rules:
        return x

    def constrain(spec_names: Any, value: Any) -> Any:
        if spec_names is None:
            return value
        spec = logical_to_mesh_axes(spec_names, rules, mesh=mesh)
        return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))

    if _is_logical_leaf(names):
        if hasattr(x, "shape"):
            return constrain(names, x)
        return jax.tree.map(lambda v: constrain(names, v), x)
    return jax.tree.map(constrain, names, x, is_leaf=_is_logical_leaf)


def _resolve_rules(rules: Rules | None) -> tuple[tuple[str, MeshAxes], ...]:
    if rules is None:
        return current_rules() or ()
    return check_rules(rules)
