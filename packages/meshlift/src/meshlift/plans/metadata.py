"""Sharding metadata: annotate parameters where they are made, read the plan back from them.

One API for NNX and linen. `ml.with_partitioning` wraps an initializer: in
an NNX module the Variable gets flax's `out_sharding` metadata; for a linen
module, or flax.core's functional `Scope` API (`scope.param`), the value is
boxed in flax's `nn.Partitioned` (`with_logical_partitioning`:
`nn.LogicallyPartitioned`). An NNX module built inside linen
(`flax.nnx.bridge.to_linen`) gets NNX metadata, a linen module inside NNX
(`bridge.ToNNX`) gets boxes: what counts is who creates the parameter.
Annotations made by flax's own functions read the same.

The tree functions accept NNX modules, `nnx.State`, linen variable dicts
with boxes, `TrainState`s and `jax.eval_shape` outputs.

Example:

```python
import jax, meshlift as ml
from flax import nnx
from jax.sharding import PartitionSpec as P

init = ml.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
layer = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
specs = ml.get_partition_spec(layer)          # nnx.State of specs
assert specs["kernel"].get_value() == P(None, "model")
mesh = ml.make_mesh({"data": 2, "model": 4})
shardings = ml.get_sharding(layer, mesh)      # NamedShardings, checked against the mesh
```
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import meta as flax_meta
from flax.nnx import graphlib, variablelib
from flax.nnx import spmd as nnx_spmd
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from meshlift import compat
from meshlift.errors import PlanError
from meshlift.paths import format_path
from meshlift.plans import annotation
from meshlift.plans.annotation import Annotated, annotated_leaves, box_value, is_box
from meshlift.plans.logical import Rules, check_rules, report_skipped
from meshlift.plans.mesh import current_mesh
from meshlift.plans.specs import spec_problems

Path = tuple[Hashable, ...]

__all__ = [
    "add_axis",
    "get_partition_spec",
    "get_sharding",
    "remove_axis",
    "replace_boxed",
    "unbox",
    "with_logical_partitioning",
    "with_partitioning",
]


# -- annotating ------------------------------------------------------------------------------


def with_partitioning(
    init_fn: Callable[..., Any],
    sharding: Sequence[Any] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    *,
    names: Sequence[Any] | None = None,
    **metadata: Any,
) -> Callable[..., Any]:
    """Wrap an initializer so its parameter carries a sharding, one name per dimension.

    In NNX (flax's `nnx.with_partitioning`) the Variable gets
    `out_sharding=sharding` metadata, plus any other `metadata` (such as
    flax's `sharding_rules`). As in flax, a name that the rules in effect map
    (its `sharding_rules`, `ml.axis_rules` / `nnx.logical_axis_rules`) is
    a logical name, and any other name is a mesh axis; the parameter is placed
    on that sharding at once if a mesh is known (`mesh=` or `ml.use_mesh`).
    For linen and flax.core's `scope.param` (linen's
    `nn.with_partitioning(fn, names)`) the value is boxed in `nn.Partitioned`,
    whose names are mesh axes.

    Args:
        init_fn: The initializer to wrap (`init_fn(key, shape, dtype)`).
        sharding: One mesh axis, logical name or None per dimension (flax NNX's name).
        mesh: The mesh to place the new parameter on; None: the one of `ml.use_mesh`,
            if any.
        names: The same as `sharding`, under linen's name; give exactly one of the two.
        **metadata: More NNX Variable metadata (such as `sharding_rules`).

    Returns:
        The wrapped initializer.

    Raises:
        TypeError: If neither or both of `sharding` and `names` are given, they are not
            a sequence of names, `sharding_rules` are malformed, or (when it runs for
            linen) `metadata` is given.
        ValueError: If a rule of `sharding_rules` repeats a mesh axis.

    Example:

    ```python
    from flax import linen as nn

    kernel_init = ml.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    nnx.Linear(16, 32, kernel_init=kernel_init, rngs=nnx.Rngs(0))     # NNX
    nn.Dense(32, kernel_init=ml.with_partitioning(nn.initializers.lecun_normal(),
                                                  (None, "model")))   # linen

    from flax import core                                             # flax.core's Scope API
    def dense(scope, x):
        return x @ scope.param("kernel", kernel_init, (x.shape[-1], 32))
    _, variables = core.init(dense)(jax.random.key(0), jnp.ones((8, 16)))
    assert isinstance(variables["params"]["kernel"], nn.Partitioned)
    ```
    """
    if (sharding is None) == (names is None):
        raise TypeError(
            "with_partitioning takes the sharding once: with_partitioning(init, (None, 'model')),"
            " or sharding= (flax's NNX name), or names= (linen's)"
        )
    names = _check_names(sharding if names is None else names, "with_partitioning")
    rules = metadata.get("sharding_rules")
    if rules is not None:
        check_rules(rules)

    @functools.wraps(init_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = init_fn(*args, **kwargs)
        if _for_flax_scope():
            if metadata:
                raise TypeError(
                    f"with_partitioning: linen's nn.Partitioned box keeps only the names and "
                    f"the mesh; {sorted(metadata)} are NNX Variable metadata"
                )
            return flax_meta.Partitioned(value, names, mesh=mesh)
        value = _place(value, Annotated((), value, None, names, "nnx", rules), mesh)
        nnx_metadata = {"out_sharding": names, "eager_sharding": False, **metadata}
        if mesh is not None:
            nnx_metadata["mesh"] = mesh
        return variablelib.VariableMetadata(value, metadata=nnx_metadata)

    return wrapper


def with_logical_partitioning(
    init_fn: Callable[..., Any],
    names: Sequence[Any],
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> Callable[..., Any]:
    """Like `with_partitioning` with logical `names`, mapped to mesh axes by axis rules.

    Linen's meaning (`nn.with_logical_partitioning`): every name is
    logical, and a name no rule maps is replicated, so one model can name
    more dimensions than a given rule set shards. (`with_partitioning`
    follows flax NNX instead: there a name no rule maps is a mesh axis.) In NNX
    the Variable gets `out_sharding=names`, `logical_names=True` and, if
    given, `sharding_rules=rules`; for linen and flax.core's `scope.param` the
    value is boxed in `nn.LogicallyPartitioned`. Rules given here apply to
    this parameter before those of `ml.axis_rules`.

    Args:
        init_fn: The initializer to wrap (`init_fn(key, shape, dtype)`).
        names: One logical name or None per dimension.
        mesh: The mesh to place the new parameter on; None: the one of `ml.use_mesh`,
            if any.
        rules: This parameter's own axis rules, applied first; None: only those in
            context.

    Returns:
        The wrapped initializer.

    Raises:
        TypeError: If `names` is not a sequence of names, or `rules` are malformed.
        ValueError: If a rule repeats a mesh axis.

    Example:

    ```python
    kernel_init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(),
                                               ("embed", "hidden"))
    with ml.axis_rules([("hidden", "model")]):
        layer = nnx.Linear(16, 32, kernel_init=kernel_init, rngs=nnx.Rngs(0))
        specs = ml.get_partition_spec(layer)
    assert specs["kernel"].get_value() == P(None, "model")
    ```
    """
    names = _check_names(names, "with_logical_partitioning")
    rules = check_rules(rules) if rules is not None else None

    @functools.wraps(init_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = init_fn(*args, **kwargs)
        if _for_flax_scope():
            from flax.linen import spmd as linen_spmd

            return linen_spmd.LogicallyPartitioned(value, names, mesh=mesh, rules=rules)
        if annotation.effective_rules(None, rules):
            value = _place(value, Annotated((), value, None, names, "logical", rules), mesh)
        metadata: dict[str, Any] = {
            "out_sharding": names,
            "logical_names": True,
            "eager_sharding": False,
        }
        if rules is not None:
            metadata["sharding_rules"] = rules
        if mesh is not None:
            metadata["mesh"] = mesh
        return variablelib.VariableMetadata(value, metadata=metadata)

    return wrapper


def _for_flax_scope() -> bool:
    """Whether the initializer runs for a flax.core `Scope` (linen, `core.init`), not for NNX.

    Neither flax.core's `scope.param` nor an NNX constructor keeps a context
    that says which one is creating a parameter (and an NNX module built by
    `bridge.to_linen` runs inside a linen module), so the caller's stack is
    read: the innermost of a `Scope.param`/`Scope.variable` call (a box) and
    a method of an NNX object (metadata) decides. Neither found: a box inside
    a linen module, else NNX metadata.
    """
    scope_module = sys.modules.get("flax.core.scope")  # not imported: no Scope can be running
    scope_codes: tuple[Any, ...] = ()
    if scope_module is not None:
        scope_codes = (scope_module.Scope.param.__code__, scope_module.Scope.variable.__code__)
    here = inspect.currentframe()
    frame = here.f_back.f_back if here is not None and here.f_back is not None else None
    try:  # from the initializer's caller outwards
        while frame is not None:
            code = frame.f_code
            if code in scope_codes:
                return True
            is_method = code.co_argcount and code.co_varnames[0] == "self"
            if is_method and isinstance(frame.f_locals.get("self"), nnx.Pytree):
                return False
            frame = frame.f_back
    finally:
        del here, frame  # no reference cycles through frames
    return compat.in_linen_module()


def _check_names(names: Any, who: str) -> tuple[Any, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence | PartitionSpec):
        raise TypeError(
            f"{who} takes one name (or None) per dimension, e.g. (None, 'model'); got "
            f"{type(names).__name__}: {names!r}"
        )
    return tuple(names)


def _place(value: Any, item: Annotated, mesh: Any) -> Any:
    """Constrain a new parameter to its spec if a mesh is known and the spec fits it.

    A rule skipped because the mesh lacks its axes is reported (an AxisRuleWarning).
    """
    mesh = mesh if mesh is not None else current_mesh()
    shape = getattr(value, "shape", None)
    if mesh is None or shape is None:
        return value
    spec, skipped = item.resolve(None, mesh, require_rules=False)
    where = f"a new parameter of shape {shape} named {item.names}"
    report_skipped({rule: [where] for rule in skipped}, strict=False)
    if spec_problems(spec, shape, dict(mesh.shape)):
        return value  # left as made; ml.explain and the transforms report a bad spec by path
    sharding = NamedSharding(mesh, spec)
    if mesh.are_all_axes_explicit:  # sharding in types: a constraint would only assert
        return jax.sharding.reshard(value, sharding)  # as flax places it there
    return jax.lax.with_sharding_constraint(value, sharding)


# -- tree functions -----------------------------------------------------------------------


def _map_boxes(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`fn` on every box/Variable/array; modules are read as their `nnx.State`."""
    if graphlib.is_graph_node(tree):
        tree = nnx.state(tree)

    def leaf(x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            return x.replace(fn(x))
        if isinstance(x, flax_meta.AxisMetadata) or hasattr(x, "shape"):
            return fn(x)
        return None

    return jax.tree.map(leaf, tree, is_leaf=is_box)


def get_partition_spec(tree: Any, rules: Any = None) -> Any:
    """The `PartitionSpec` of every array in `tree`; unannotated arrays get `P()`.

    Boxes are replaced by their spec (as `nn.get_partition_spec` does); for
    NNX modules and `nnx.State` the result is an `nnx.State` of specs.

    Logical names follow flax's two recipes. A linen box
    (`nn.LogicallyPartitioned`) gives its logical names, as
    `nn.get_partition_spec` does, also inside `ml.axis_rules`, so that
    `ml.logical_to_mesh_sharding(specs, mesh, rules)` maps them once (flax's
    `nn.get_partition_spec` + `nn.logical_to_mesh_sharding`). An NNX Variable's
    logical names are mapped by its own rules and those in context, as
    `nnx.get_partition_spec` does (outside any rules they stay logical). Passing
    `rules=` maps both kinds with exactly those rules.

    Args:
        tree: A module, `nnx.State`, linen variable dict, `TrainState` or abstract tree.
        rules: Axis rules for every logical name; None: as described above.

    Returns:
        `tree` with a `PartitionSpec` per array (an `nnx.State` for a module).

    Raises:
        TypeError: If `rules` are malformed.
        ValueError: If a rule repeats a mesh axis, or a logical name names two
            dimensions of one array.

    Example:

    ```python
    from flax import linen as nn

    init = ml.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(32, kernel_init=init)
    x = jnp.ones((8, 16))
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    specs = ml.get_partition_spec(abstract)   # {'params': {'bias': P(), 'kernel': P(None, 'model')}}
    assert specs["params"]["kernel"] == P(None, "model")

    logical = nn.Dense(32, kernel_init=ml.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))
    abstract = jax.eval_shape(logical.init, jax.random.key(0), x)
    rules = [("mlp", "model")]
    with ml.axis_rules(rules):
        specs = ml.get_partition_spec(abstract)          # logical: P('embed', 'mlp')
    mesh = ml.make_mesh({"data": 2, "model": 4})
    shardings = ml.logical_to_mesh_sharding(specs, mesh, rules)
    assert shardings["params"]["kernel"].spec == P(None, "model")
    ```
    """

    def spec(x: Any) -> PartitionSpec:
        item = Annotated.of(x)
        if rules is None and item.kind == "logical" and item.names and hasattr(x, "names"):
            return PartitionSpec(*item.names)  # a linen box: logical, as nn.get_partition_spec
        return item.resolve(rules, require_rules=False)[0]

    return _map_boxes(spec, tree)


def get_sharding(
    tree: Any,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Rules | None = None,
    *,
    strict: bool = False,
) -> Any:
    """A `NamedSharding` on `mesh` for every array in `tree`, checked against the mesh.

    Same structure as `get_partition_spec`, and usable as `out_shardings`
    of `jax.jit`. Every spec that cannot shard its array (an axis the mesh
    lacks, an axis used twice, too many entries, a dimension not divisible) is
    reported in one `ml.PlanError` with its path. `mesh` defaults to the
    one of `ml.use_mesh`. An axis rule skipped because the mesh lacks its
    axes, or one whose logical name no parameter has while a name close to it
    has no rule (a typo), gives an `ml.AxisRuleWarning` naming the parameters
    (with `strict=True`, a PlanError).

    Args:
        tree: A module, `nnx.State`, linen variable dict, `TrainState` or abstract tree.
        mesh: The mesh; None: the one of `ml.use_mesh`.
        rules: Logical axis rules; None: those in context.
        strict: Make a rule skipped for an axis the mesh lacks, or one that does nothing
            for a typo, a `PlanError` instead of an `ml.AxisRuleWarning`.

    Returns:
        `tree` with a `NamedSharding` per array (an `nnx.State` for a module).

    Raises:
        TypeError: If there is no mesh, or `rules` are malformed.
        meshlift.PlanError: Listing every parameter whose spec does not fit the mesh, or
            whose logical names have no rules; with `strict=True`, for a skipped rule.

    Example:

    ```python
    from flax import linen as nn

    init = ml.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(32, kernel_init=init)
    init_fn, key, x = model.init, jax.random.key(0), jnp.ones((8, 16))
    abstract = jax.eval_shape(init_fn, key, x)
    state_sharding = ml.get_sharding(abstract, ml.make_mesh({"data": 2, "model": 4}))
    variables = jax.jit(init_fn, out_shardings=state_sharding)(key, x)
    ```
    """
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise TypeError("get_sharding needs a mesh: pass one, or call inside ml.use_mesh(mesh)")
    problems: list[str] = []
    items = annotated_leaves(tree)
    skipped_for: dict[Any, list[str]] = {**annotation.unused_rules_of(items, rules, mesh)[0]}
    for item in items:
        try:
            spec, skipped = item.resolve(rules, mesh)
        except PlanError as error:
            problems.append(str(error))
            continue
        for rule in skipped:
            skipped_for.setdefault(rule, []).append(f"`{format_path(item.path)}`")
        found = spec_problems(spec, item.shape, dict(mesh.shape))
        if found:
            problems.append(
                f"`{format_path(item.array_path)}` (shape {item.shape}, spec {spec}): "
                + "; ".join(found)
            )
    if problems:
        raise PlanError(
            f"{len(problems)} parameter(s) cannot be sharded on mesh {dict(mesh.shape)}:\n  "
            + "\n  ".join(problems)
            + "\nFix the annotation (ml.with_partitioning) or the axis rules, or use a mesh "
            "whose axes divide these dimensions."
        )
    report_skipped(skipped_for, strict=strict)

    def sharding(x: Any) -> NamedSharding:
        item = Annotated.of(x)
        return NamedSharding(mesh, item.resolve(rules, mesh)[0])

    return _map_boxes(sharding, tree)


def unbox(tree: Any) -> Any:
    """The arrays alone: flax boxes and NNX Variables replaced by their values.

    A module gives the nested dict of its arrays (`nnx.to_pure_dict`).

    Args:
        tree: A module, `nnx.State`, or a pytree holding boxes or Variables.

    Returns:
        The same tree of plain arrays; for a module, a nested dict.

    Example:

    ```python
    from flax import linen as nn

    init = ml.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(32, kernel_init=init)
    variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
    params = ml.unbox(variables["params"])   # plain dict of arrays
    ```
    """
    if graphlib.is_graph_node(tree):
        return nnx.to_pure_dict(nnx.state(tree))

    def leaf(x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            return unbox(x.get_value())
        if isinstance(x, flax_meta.AxisMetadata):
            return unbox(box_value(x))
        return x

    return jax.tree.map(leaf, tree, is_leaf=is_box)


def replace_boxed(tree: Any, updates: Any) -> Any:
    """`tree` with each boxed value replaced by the matching array of `updates`.

    The boxes (and their annotations) stay; `updates` is shaped like
    `ml.unbox(tree)`. For a module, its Variables are updated in place and the
    module is returned.

    Args:
        tree: A module, `nnx.State`, or a pytree holding boxes or Variables.
        updates: The new arrays, shaped like `ml.unbox(tree)`.

    Returns:
        The updated tree; for a module, the module itself.

    Example:

    ```python
    from flax import linen as nn

    init = ml.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(32, kernel_init=init)
    variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
    new_variables = ml.replace_boxed(variables, ml.unbox(variables))
    ```
    """
    if graphlib.is_graph_node(tree):
        state = nnx.state(tree)
        nnx.replace_by_pure_dict(state, updates)
        nnx.update(tree, state)
        return tree
    if isinstance(tree, nnx.State):
        state = jax.tree.map(lambda v: v, tree, is_leaf=is_box)
        nnx.replace_by_pure_dict(state, updates)
        return state

    def leaf(x: Any, new: Any) -> Any:
        if isinstance(x, nnx.Variable):
            return x.replace(new)
        if isinstance(x, flax_meta.AxisMetadata):
            return x.replace_boxed(replace_boxed(box_value(x), new))
        return new

    return jax.tree.map(leaf, tree, updates, is_leaf=is_box)


def add_axis(tree: Any, index: int, axis_name: str | None) -> Any:
    """Insert `axis_name` at `index` in every annotation, as scan/vmap over layers do.

    Stacking layers gives each parameter a new leading axis; with
    `axis_name="layers"` its spec gains `'layers'` there (`None`: not
    sharded). NNX Variables are updated in place; linen boxes are replaced.

    Args:
        tree: A module, `nnx.State`, or a pytree holding boxes or Variables.
        index: Where the new axis goes in each annotation.
        axis_name: Its name; None: not sharded.

    Returns:
        The tree with the axis added; for a module, the module itself.

    Example:

    ```python
    from flax import linen as nn

    init = ml.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(32, kernel_init=init)
    variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
    stacked = ml.add_axis(variables, 0, "layers")   # (None, 'model') -> ('layers', None, 'model')
    ```
    """
    return _axis_op(tree, index, axis_name, add=True)


def remove_axis(tree: Any, index: int, axis_name: str | None) -> Any:
    """Remove the entry at `index` (which must be `axis_name`) from every annotation.

    The inverse of `add_axis`: NNX Variables are updated in place; linen boxes
    are replaced.

    Args:
        tree: A module, `nnx.State`, or a pytree holding boxes or Variables.
        index: The position of the axis in each annotation.
        axis_name: The name at `index` (None for an unsharded axis).

    Returns:
        The tree with the axis removed; for a module, the module itself.

    Example:

    ```python
    from flax import linen as nn

    init = ml.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(32, kernel_init=init)
    variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
    stacked = ml.add_axis(variables, 0, "layers")
    layer = ml.remove_axis(stacked, 0, "layers")    # ('layers', None, 'model') -> (None, 'model')
    ```
    """
    return _axis_op(tree, index, axis_name, add=False)


def _axis_op(tree: Any, index: int, axis_name: str | None, *, add: bool) -> Any:
    params = {flax_meta.PARTITION_NAME: axis_name}
    nnx_op = nnx_spmd.add_axis if add else nnx_spmd.remove_axis
    if graphlib.is_graph_node(tree):
        for _, node in nnx.graph.iter_graph(tree):
            if isinstance(node, nnx.Variable):
                nnx_op(node, index, params)
        return tree

    def leaf(x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            return nnx_op(x, index, params)
        if isinstance(x, flax_meta.AxisMetadata):
            return x.add_axis(index, params) if add else x.remove_axis(index, params)
        return x

    return jax.tree.map(leaf, tree, is_leaf=is_box)
