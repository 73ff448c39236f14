"""The function handed to a backend: arrays in, arrays out, no reference to a caller's object.

`PureFunction` rebuilds the caller's graph nodes from their arrays, calls the
user's function on them, and returns what changed; `TraceInfo` is what its
trace learned, carried out of the staged function as static output data
(`Aux`), so the caller can write back without tracing again. As flax's
`JitFn` is to `nnx.jit`, this is the body of a lifted function, apart from
its wrapper (`meshlift.call.lift.Lifted`).

Example:

```python
from meshlift.call.arguments import Signature
from meshlift.call.layout import Call, Layout, Names, flatten_arguments

def step(model, x):
    model.bias[...] += 1
    return model(x)

model, x = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), jnp.ones((1, 2))
leaves, treedef = flatten_arguments((model, x), {})
call = Call(leaves, (model,))
layout = Layout((model, x), {}, call, treedef, (), None, step,
                signature=Signature(step), names=Names("step"))
var_out, extra, out, aux = layout.pure(*layout.inputs(layout.split.gather(), call))
assert aux.info.changed == (0,)              # the bias (split order: bias, kernel)
assert var_out[1] is None and out.shape == (1, 3)
assert float(model.bias[...].sum()) == 0.0   # the caller's model is not touched
```
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from meshlift import compat
from meshlift.call import static_changes
from meshlift.call.arguments import insert_statics, named_statics
from meshlift.call.static_changes import StaticValues
from meshlift.errors import TraceLeakError
from meshlift.graph.split import (
    GraphSplit,
    GraphUpdate,
    OutputNodes,
    Rebuilt,
    StaticObjects,
    abstract_index_map,
    caller_statics,
    decode_outputs,
    encode_outputs,
)
from meshlift.paths import Path, format_path


class TraceInfo:
    """What tracing learned that the caller needs, carried out as static output data."""

    def __init__(
        self,
        changed: tuple[int, ...],
        update: GraphUpdate | None,
        outputs: OutputNodes,
        container: type | None,
        traced: Any,
    ):
        self.changed = changed  # split positions of Variables with new values
        self.pick_changed = picker(changed)  # their values out of the staged output
        self.update = update  # a new graph for the arguments' nodes, if more than values changed
        self.outputs = outputs  # graph nodes in the output
        self.container = container  # the output's own list or tuple type, if staged as the other
        self.traced = traced  # the split's graphdef it was traced from (its static objects)

    def statics(self, split: GraphSplit) -> StaticObjects:
        """The caller's static objects for those tracing saw, where a graph is rebuilt."""
        if self.update is None and not self.outputs.graphdefs:
            return None
        return caller_statics(self.traced, split.graphdef)

    def decode(self, user_out: Any, index_map: Any, statics: StaticObjects = None) -> Any:
        """The caller's output: graph nodes rebuilt, its own top-level list or tuple."""
        out = decode_outputs(user_out, self.outputs, index_map, statics)
        return out if self.container is None else self.container(out)


class StaleLayout(BaseException):
    """Raised as a staged function starts tracing: a Variable holds a value of another
    structure, shape or dtype than its layout was made for (see `held_types`). Not an
    error: the lifted function makes a new layout, as on a first call (`Lifted._call`,
    `Lifted._staged`). A BaseException, as `GeneratorExit` is, so that the `except
    Exception` between the trace and the lifted function (JAX's, a backend's, meshlift's
    own error handling) lets it through unchanged."""


def held_types(values: Sequence[Any]) -> tuple[Any, ...]:
    """For each Variable's value (or array stored on a module), the pytree structure it
    holds and each array's shape and dtype, as JAX traces them: what a layout's
    shardings and input names were made for.

    Example:

    ```python
    import numpy as np
    from meshlift.call.pure import held_types

    assert held_types([jnp.ones((2, 3))]) == held_types([np.ones((2, 3), np.float32)])
    assert held_types([jnp.ones((2, 3))]) != held_types([{"a": jnp.ones((2, 3))}])
    assert held_types([jnp.ones((2, 3))]) != held_types([jnp.ones((4, 3))])
    ```
    """
    return tuple(map(_held_type, values))


def _held_type(value: Any) -> tuple[Any, tuple[Any, ...]]:
    leaves, treedef = jax.tree.flatten(value)
    return treedef, tuple(map(_shape_dtype, leaves))


def _shape_dtype(x: Any) -> Any:
    if not isinstance(x, jax.Array):  # else an array, or a tracer of one: dtype canonical
        try:
            x = jax.typeof(x)  # a NumPy array, a number, a reference: as JAX traces it
        except TypeError:  # no JAX type: JAX refuses it as an input, naming it
            return type(x)
    return x.shape, x.dtype


def _holds_block(traced: Any, whole: Any, scale: tuple[int, ...]) -> bool:
    """Whether the held type `traced` is a block of the held type `whole`, cut `scale[i]`
    times along dimension `i`; a dimension cut into blocks of 1 may be absent."""
    (treedef, leaves), (whole_treedef, whole_leaves) = traced, whole
    return treedef == whole_treedef and all(
        _is_block(leaf, each, scale) for leaf, each in zip(leaves, whole_leaves, strict=True)
    )


def _is_block(leaf: Any, whole: Any, scale: tuple[int, ...]) -> bool:
    if type(leaf) is not tuple or type(whole) is not tuple or leaf[1] != whole[1]:
        return leaf == whole  # a type JAX has no array for; else another dtype
    (shape, _), (whole_shape, _) = leaf, whole
    cuts = (*scale, *(1,) * len(whole_shape))[: len(whole_shape)]
    if any(d % n for d, n in zip(whole_shape, cuts, strict=True)):
        return False
    block = tuple(d // n for d, n in zip(whole_shape, cuts, strict=True))
    kept = tuple(b for b, n in zip(block, cuts, strict=True) if not (b == 1 and n > 1))
    return shape in (block, kept)


def _manual_axes() -> frozenset[str]:
    """The mesh axes a trace is manual over (inside a shard_map), where it runs now."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _shard_scales(specs: Sequence[Any], axes: frozenset[str]) -> list[tuple[int, ...]]:
    """Per Variable, how many times a per-shard block over the manual `axes` fits in the
    whole array along each dimension, from the Variable's spec (None: whole)."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    scales = []
    for spec in specs:
        scale = []
        for entry in () if spec is None else spec:
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            scale.append(math.prod(sizes[a] for a in names if a in axes))
        scales.append(tuple(scale))
    return scales


def _mesh_context(mesh: Any) -> contextlib.AbstractContextManager:
    """The mesh context the lifted function is traced in: `mesh` (the transform's `mesh=`,
    or the call site's) where the trace has none, as under `jax.set_mesh(mesh)`, so that
    code sharding in types (`jnp.zeros(..., out_sharding=P("data"))`) finds it."""
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    return jax.sharding.use_abstract_mesh(abstract)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # meshlift's files


@jax.tree_util.register_pytree_node_class
class Aux:
    """A childless output node carrying a TraceInfo through jax's output treedef."""

    __slots__ = ("info",)

    def __init__(self, info: TraceInfo):
        self.info = info

    def tree_flatten(self) -> tuple[tuple[()], TraceInfo]:
        return (), self.info

    @classmethod
    def tree_unflatten(cls, info: TraceInfo, _: Any) -> Aux:
        return cls(info)


class PureFunction:
    """The function a backend stages for one argument layout (`meshlift.call.layout.Layout`).

    Takes four tuples (kept Variables, kept other leaves, donated Variables,
    donated other leaves) and returns `(variables, extra, output, aux)`: one
    entry per Variable of the split (`None` where tracing found it unchanged),
    the leaves of Variables the function created (on a graph update), the
    output with graph nodes replaced by their arrays, and an `Aux`.
    """

    def __init__(self, fun: Callable[..., Any], layout: Any, arg_names: tuple[str, ...]):
        self.fun_ref = _weak(fun)  # the cache of staged functions must not keep it
        self.graphdef = layout.split.graphdef
        self.unchanged_graphdef = self.graphdef.with_same_outer_index()
        self.treedef, self.statics = layout.treedef, layout.statics
        self.node_pos = layout.node_pos
        self.var_order = layout.var_groups[0] + layout.var_groups[1]
        self.dyn_order = layout.dyn_groups[0] + layout.dyn_groups[1]
        self.passed = layout.passed
        self.donated = frozenset(layout.var_groups[1])
        self.names = [format_path(layout.leaf_paths[i]) for i in layout.node_pos]
        self.leaf_position = {
            index: i for i, index in enumerate(layout.split.leaf_index) if index is not None
        }
        self.arrays = tuple(i for i, index in enumerate(layout.split.leaf_index) if index is None)
        out_specs = layout.out_specs
        self.out_container = type(out_specs) if type(out_specs) in (list, tuple) else None
        self.key = layout.key
        self.held = layout.held
        self.checked_dyn = tuple(map(self.dyn_order.index, layout.checked_leaves))
        shardings = (*layout.var_shardings, *map(layout.dyn_shardings.get, layout.checked_leaves))
        self.held_specs = tuple(getattr(s, "spec", None) for s in shardings)
        self.manual = _manual_axes()  # those of a shard_map the layout was made inside
        self.mesh = layout.mesh  # the function's mesh context where the trace has none
        self.__name__ = getattr(fun, "__name__", "lifted")
        self.__qualname__ = getattr(fun, "__qualname__", self.__name__)
        code = _code(fun)
        if code is not None:  # where JAX's messages say the function is ("step at x.py:12")
            self.__code__ = code
        # JAX's messages name the inputs as the caller does (`m.kernel`), not `kept_vars[1]`
        self.input_names = arg_names
        info = compat.debug_info(layout.names.backend, fun, arg_names)
        if info is not None:
            self.__fun_debug_info__ = info
        compat.hide_from_source_info(_PACKAGE)  # "TRACING CACHE MISS at" the caller's line

    def __call__(
        self,
        kept_vars: tuple[Any, ...],
        kept_dyn: tuple[Any, ...],
        donated_vars: tuple[Any, ...],
        donated_dyn: tuple[Any, ...],
    ) -> tuple[tuple[Any, ...], tuple[Any, ...], Any, Aux]:
        values: list[Any] = [None] * len(self.var_order)
        for i, value in zip(self.var_order, (*kept_vars, *donated_vars), strict=True):
            values[i] = value
        dyn = (*kept_dyn, *donated_dyn)
        checked = [*values, *map(dyn.__getitem__, self.checked_dyn)]
        if not self._held_as_laid_out(checked):  # JAX traces again for another kind of value
            raise StaleLayout(
                f"{self.__name__} is traced for other values than its layout's (a Variable's "
                f"structure, shape or dtype changed): meshlift makes a new layout"
            )
        rebuilt = Rebuilt(self.graphdef, values)
        leaves: list[Any] = [None] * (len(self.node_pos) + len(self.dyn_order) + len(self.passed))
        for i, node in zip(self.node_pos, rebuilt.nodes, strict=True):
            leaves[i] = node
        for i, value in self.passed.items():
            leaves[i] = value
        for i, value in zip(self.dyn_order, (*kept_dyn, *donated_dyn), strict=True):
            leaves[i] = value
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        _LAST_TRACE.key, _LAST_TRACE.state = self.key, RUNNING
        fun = self.fun_ref()
        statics = StaticValues(rebuilt.nodes)  # the caller's own objects, shared by the trace
        try:
            with _mesh_context(self.mesh):
                out = fun(
                    *insert_statics(args, self.statics), **kwargs, **named_statics(self.statics)
                )
        except BaseException:
            statics.restore()
            raise
        if changed_in_place := statics.changed():  # kept or undone by the call in progress
            leak = statics.tracer_in(changed_in_place)
            if leak is not None:
                statics.restore()
                raise TraceLeakError(
                    f"{self.__name__} stored a traced value at `{self._caller_path(leak)}`, in "
                    f"a static value (an object that is not a Variable or a module): it is no "
                    f"output of the staged function, so after the call it would be a leaked "
                    f"tracer (JAX's UnexpectedTracerError where it is read). It was undone. "
                    f"Keep it in a Variable on a module (`m.cache = nnx.Variable(x)`), or "
                    f"return it."
                )
            static_changes.record(statics, tuple(map(self._caller_path, changed_in_place)))

        ref_index, new_values, update = rebuilt.changes(
            self.unchanged_graphdef, self.leaf_position, self.arrays
        )
        extra: list[Any] = []
        if update is None:
            # A Variable holding a container (sow, capture, perturb) may be changed in place.
            changed = tuple(
                i
                for i, (new, old) in enumerate(zip(new_values, values, strict=True))
                if (new is not old or i in self.donated or not hasattr(old, "shape"))
                and not (new is old and compat.is_ref(old))  # a reference, mutated through
            )
            kept = frozenset(changed)
            var_out = tuple(v if i in kept else None for i, v in enumerate(new_values))
        else:
            update.check_metadata(self.graphdef, self.names)
            var_list: list[Any] = [None] * len(values)
            for value, source in zip(new_values, update.sources, strict=True):
                if source is None:
                    extra.append(value)
                elif source not in update.in_place:
                    var_list[source] = value
            for position, value in rebuilt.detached.items():
                var_list[position] = value
            changed, var_out = (), tuple(var_list)
        container = type(out)
        if container in (list, tuple) and self.out_container not in (None, container):
            out = self.out_container(out)  # a list of specs matches a tuple output, and back
        user_out, outputs = encode_outputs(out, ref_index)
        info = TraceInfo(
            changed,
            update,
            outputs,
            container if type(out) is not container else None,
            self.graphdef,
        )
        _LAST_TRACE.state = RETURNED
        return var_out, tuple(extra), user_out, Aux(info)

    def _held_as_laid_out(self, values: Sequence[Any]) -> bool:
        """Whether the traced `values` hold what the layout was made for (`held_types`).
        Per-shard blocks (a backend that stages per shard) are compared with the blocks of
        the whole arrays; a dimension split into blocks of 1 may be absent, as pmap's
        `in_axes` hands each device its slice."""
        manual = _manual_axes() - self.manual
        if not manual:
            return held_types(values) == self.held
        scales = _shard_scales(self.held_specs, manual)
        return all(map(_holds_block, held_types(values), self.held, scales))

    def _caller_path(self, path: Path) -> str:
        """A path below the graph nodes (node position first) in the caller's names."""
        return format_path((self.names[path[0]], *path[1:]))  # type: ignore[call-overload]


class _LastTrace(threading.local):
    """How far the last trace of a pure function in this thread got: `key` is its layout's,
    `state` RUNNING from when the lifted function is called, RETURNED once all returned."""

    key: Any = None
    state: str | None = None


RUNNING, RETURNED = "running", "returned"
_LAST_TRACE = _LastTrace()


def last_trace(key: Any) -> str | None:
    """RUNNING if the last trace for the layout `key` stopped inside the lifted function
    (it raised there), RETURNED if it returned, None if no trace of it is on record."""
    return _LAST_TRACE.state if _LAST_TRACE.key == key else None


def abstract_outputs(fun: Callable[..., Any], layout: Any, call: Any) -> tuple[Any, TraceInfo]:
    """`fun`'s output for `layout` and `call`, graph nodes rebuilt as abstract modules, and
    what tracing found; nothing runs and nothing is written back."""
    values = [_abstract(v) for v in layout.split.gather()]
    evaluate = getattr(fun, "eval_shape", None) or functools.partial(jax.eval_shape, fun)
    var_out, extra, user_out, aux = evaluate(*layout.inputs(values, call))
    info = aux.info
    index_map = abstract_index_map(layout.split.graphdef, values)
    statics = info.statics(layout.split)
    if info.update is not None:
        index_map = info.update.apply(info.update.leaves(var_out, extra), index_map, statics)
    return info.decode(user_out, index_map, statics), info


def picker(positions: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function taking the items at `positions` out of a sequence, as a tuple."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda items: (items[i],)
    return lambda items: ()


def _weak(fun: Callable[..., Any]) -> Callable[[], Any]:
    """A weak reference to `fun`, or a strong one where it cannot be weakly referenced."""
    try:
        return weakref.ref(fun)
    except TypeError:
        return lambda: fun


def _code(fun: Any) -> Any:
    """The code object of `fun`, through partials and wrappers; None for other callables."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    return getattr(inspect.unwrap(fun), "__code__", None)


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x
