"""The one lifted transform every backend shares.

`Lifted` keeps two caches: argument layouts, keyed by where every graph node
sits among the arguments and which objects they are (held weakly, dropped
with the model), and staged functions, keyed by structure only (a fingerprint,
never an identity) and shared by every `Lifted` of the same function and
options, as `jax.jit` shares its cache between wrappers. A call gathers
arrays, calls, validates every write, then writes back: all or nothing.
`transform` below shows a train step.

Example:

```python
import jax.numpy as jnp
import meshlift as ml

traces = []

def double(x):
    traces.append(x)
    return 2 * x

ml.jit(double)(jnp.ones(2))
ml.jit(double)(jnp.ones(2))     # a new wrapper of the same function: the same program
assert len(traces) == 1
```
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import operator
import re
import types
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeAlias, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, Sharding

from meshlift import compat, modes, resolve, speedups
from meshlift.arguments import Signature, insert_statics, named_statics, static_key
from meshlift.backend import Backend, StageSpec
from meshlift.graph import (
    GraphSplit,
    GraphUpdate,
    OutputNodes,
    Rebuilt,
    StaticObjects,
    abstract_index_map,
    caller_statics,
    decode_outputs,
    encode_outputs,
    is_graph_leaf,
    is_graph_type,
    raw,
)
from meshlift.mesh import current_mesh
from meshlift.paths import (
    Path,
    PlanError,
    StructureChangedError,
    TraceLeakError,
    format_path,
    listing,
)
from meshlift.plugins import get_backend
from meshlift.sharding import StateSharding, is_spec
from meshlift.stages import Lowered, Traced
from meshlift.static_changes import StaticValues
from meshlift.structure import per_type

Params = ParamSpec("Params")  # the lifted function's parameters
Result = TypeVar("Result")  # and what it returns
# What `mesh=` takes: a mesh, a function giving one at each call, or None (the call site's).
MeshLike: TypeAlias = Mesh | AbstractMesh | Callable[[], Mesh | AbstractMesh | None] | None

_MAX_LAYOUTS = 8  # argument layouts remembered per lifted function
# jax.jit aliases a mutable array reference to an output of its own, and may give a donated
# buffer that same output: XLA then fails (seen on jax 0.10.2). Donation is a hint.
_REF_DONATION = (
    "{} takes ref=True Variables (mutable array references), so nothing is donated on this "
    "call: XLA can fail to alias a donated buffer beside a reference (jax 0.10). Donate in "
    "calls without references, or make those Variables plain"
)
# the staged function's four inputs, as JAX's messages name them
_INPUT_GROUPS = {"kept_vars": 0, "kept_dyn": 1, "donated_vars": 2, "donated_dyn": 3}
_STAGED_INPUT = re.compile(r"\b(kept_vars|kept_dyn|donated_vars|donated_dyn)\[(\d+)\]")
_STAGED_OUTPUT = re.compile(r"\b(out_specs|out_shardings)((?:\[\d+\])+)")


class Lifted(Generic[Params, Result]):
    """A function lifted over stateful arguments, staged by one backend.

    Made by `ml.transform` (the front ends `ml.jit`, `ml.shard_map` and
    `ml.pjit` go through it). Calling it runs the staged function and writes
    updated Variables back; `trace`, `lower` and `eval_shape` give JAX's
    stages, wrapped so that compiled objects are called with modules too.

    `mesh` is a mesh, a function returning one at each call (how a backend
    reads a call-site context), or None for the mesh of `ml.use_mesh`.
    `spec_names` are the front end's names for the specs, used in errors.
    `meshless_specs`, if given, are `(in_specs, out_specs)` for a call with
    no mesh in context, where a front end reads its specs differently then
    (old `pjit`'s `None`: replicated on the mesh, else the compiler's choice).
    """

    def __init__(
        self,
        fun: Callable[Params, Result],
        backend: str | Backend,
        *,
        in_specs: Any = None,
        out_specs: Any = None,
        mesh: MeshLike = None,
        static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
        options: Mapping[str, Any] | None = None,
        spec_names: tuple[str, str] = ("in_specs", "out_specs"),
        meshless_specs: tuple[Any, Any] | None = None,
    ):
        if not callable(fun):
            raise TypeError(f"expected a function to lift, got {type(fun).__name__}: {fun!r}")
        if not (mesh is None or callable(mesh) or isinstance(mesh, Mesh | AbstractMesh)):
            shape = dict(mesh) if isinstance(mesh, Mapping) else {"data": 2, "model": 4}
            raise TypeError(
                f"mesh= takes a jax.sharding.Mesh (or AbstractMesh), got "
                f"{type(mesh).__name__}: {mesh!r}; make one with `ml.make_mesh({shape})`"
            )
        functools.update_wrapper(self, fun)
        self.backend = get_backend(backend)
        self.in_name, self.out_name = spec_names
        self.in_specs = _checked_specs(in_specs, self.in_name)
        self.out_specs = _checked_specs(out_specs, self.out_name)
        self.meshless_specs = meshless_specs
        self.mesh = mesh
        self.options = dict(options or {})
        argnums = (static_argnums, static_argnames, donate_argnums, donate_argnames)
        self._receiver = _graph_receiver(fun)
        if self._receiver is not None:  # `m.method`: m becomes the first argument of each call
            Signature(fun, *argnums)  # jax.jit's checks, against the signature the caller sees
            fun, argnums = fun.__func__, _after_receiver(*argnums)  # type: ignore[attr-defined]
            self.in_specs, self.meshless_specs = _with_receiver_spec(in_specs, meshless_specs)
        self.fun = fun
        self.signature = Signature(fun, *argnums)
        self._graph_context = compat.graph_context()
        self._layouts = _LayoutCache()
        self._last: _Repeat | None = None  # the last call, if the next may skip the lookup
        self._plan: speedups.CallPlan | None = None  # the last call's, if the next may repeat it
        self._passed: dict[Any, tuple[int, ...]] = {}  # treedef -> leaves passed through
        self._staged = _shared_stages(fun, self._options_key())

    def __repr__(self) -> str:
        return f"<meshlift.{self.backend.name} of {getattr(self.fun, '__qualname__', self.fun)}>"

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Lifted[Params, Result]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Result]: ...

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else _BoundLifted(self, obj)

    def __call__(self, *args: Params.args, **kwargs: Params.kwargs) -> Result:
        if self._receiver is not None:
            args = (self._receiver, *args)  # type: ignore[assignment]
        cached = self._graph_context.tmp_static_cache is not None
        if cached:  # called by nnx.cached_partial: take its cache, as flax's transforms do
            self._graph_context.tmp_static_cache = None
        plan = self._plan
        if plan is not None and not kwargs:
            inputs = speedups.plan_inputs(plan, args)
            if inputs is not None:
                return self._run_planned(plan, args, inputs, cached)
        layout, call = self._layout(args, kwargs)
        call.fixed_structure = cached
        result = layout.run(layout.staged, call)
        self._plan = self._plan_after(layout) if modes.fast_paths else None
        return result

    def _run_planned(
        self, plan: speedups.CallPlan, args: tuple, inputs: tuple, cached: bool
    ) -> Any:
        """A call that `plan` matched: its inputs read, its outputs written back, each in
        one step; an error, a retrace or a value that is no array goes the general way."""
        layout = plan.layout
        try:
            outputs = plan.staged(*inputs)
        except Exception as error:
            call = _Call.of_arguments(args, plan.node_positions, cached)
            return layout.recover(error, plan.staged, layout.split.gather(), None, call)
        if speedups.plan_write(plan, outputs):
            return outputs[2]
        call = _Call.of_arguments(args, plan.node_positions, cached)
        result = layout.finish(outputs, layout.split.gather(), None, call)
        self._plan = self._plan_after(layout)
        return result

    def _plan_after(self, layout: _Layout) -> speedups.CallPlan | None:
        """The plan for calls like the last one, which ran `layout`: None unless its
        arguments let the next call skip the lookup (`_Repeat`) and it wrote back only
        Variables' arrays (no graph update, no graph node in its output)."""
        last, info, split = self._last, layout.info, layout.split
        if last is None or last.layout is not layout or info is None:
            return None
        if info.update is not None or info.outputs.graphdefs or info.container is not None:
            return None
        access, array_type = split.slot_access(info.changed), compat.array_type()
        if access is None or array_type is None:
            return None
        mesh_source: Callable[[], Any] | None
        if self.mesh is None:  # the call site's mesh, as jax's reader gives it
            mesh_source = compat.mesh_reader()
            try:
                mesh = mesh_source()
            except Exception:  # refused inside a trace
                return None
        elif isinstance(self.mesh, Mesh | AbstractMesh):
            mesh_source, mesh = None, last.mesh
        else:
            mesh_source, mesh = self.mesh, last.mesh
        slot, variables, targets = access
        if not all(type(value) is array_type for value in speedups.read_each(slot, targets)):
            return None  # a typed key, a container changed in place: each call would miss
        (kept_vars, donated_vars), (kept_dyn, donated_dyn) = layout.var_groups, layout.dyn_groups
        return speedups.CallPlan(
            mesh_source,
            mesh,
            last.types,
            last.positions,
            last.refs,
            split.unchanged,
            slot,
            tuple(map(variables.__getitem__, kept_vars)),
            kept_dyn,  # positions of leaves, here of arguments
            tuple(map(variables.__getitem__, donated_vars)),
            donated_dyn,
            info,
            info.changed,
            targets,
            array_type,
            layout.staged,
            layout,
        )

    def trace(self, *args: Params.args, **kwargs: Params.kwargs) -> Traced:
        """Trace for these arguments; `.lower()` continues. Nothing is written back."""
        layout, call = self._layout(self._bound(args), kwargs)
        with layout.named_errors(call):
            return Traced(layout.staged.trace(*layout.placed_inputs(call)), layout)

    def lower(self, *args: Params.args, **kwargs: Params.kwargs) -> Lowered:
        """Lower for these arguments; `.compile()` gives a `Compiled` called like this
        function, without the static arguments (they are part of the program)."""
        layout, call = self._layout(self._bound(args), kwargs)
        with layout.named_errors(call):
            return Lowered(layout.staged.lower(*layout.placed_inputs(call)), layout)

    def eval_shape(self, *args: Params.args, **kwargs: Params.kwargs) -> Any:
        """Output shapes and dtypes, graph outputs as abstract modules; nothing is written back."""
        layout, call = self._layout(self._bound(args), kwargs)
        with layout.named_errors(call):
            return layout.eval_shape(call)

    def _bound(self, args: tuple) -> tuple:
        """The arguments with the receiver of a lifted bound method first."""
        return args if self._receiver is None else (self._receiver, *args)

    @property
    def fun_name(self) -> str:
        return getattr(self.fun, "__name__", "the lifted function")

    def specs_on(self, mesh: Any) -> tuple[Any, Any]:
        """`(in_specs, out_specs)` for a call on `mesh` (None: no mesh in context)."""
        if mesh is None and self.meshless_specs is not None:
            return self.meshless_specs
        return self.in_specs, self.out_specs

    def _options_key(self) -> Hashable | None:
        """Everything besides the arguments that the staged functions depend on; None if
        some option is unhashable (then this function keeps its staged functions to itself)."""
        sig = self.signature
        key = (
            self.backend,
            self.in_name,
            self.out_name,
            _spec_key(self.in_specs),
            _spec_key(self.out_specs),
            _spec_key(self.meshless_specs),
            sig.static_argnums,
            sig.static_argnames,
            sig.donate_argnums,
            sig.donate_argnames,
            tuple(sorted(self.options.items())),
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _layout(self, args: tuple, kwargs: dict, mesh: Any = None) -> tuple[_Layout, _Call]:
        """The layout for these arguments (made if new or stale), and this call's leaves.

        `mesh` overrides the call-site lookup (a compiled object keeps its mesh).
        """
        mesh = self._call_site_mesh() if mesh is None else mesh
        last = self._last if modes.fast_paths else None
        if last is not None and not kwargs and last.mesh is mesh and last.matches(args):
            call = _Call.of_arguments(args, last.positions)
            if last.layout.split.unchanged():
                return last.layout, call
        args, kwargs, statics = self.signature.pop_statics(args, kwargs)
        if kwargs and self.specs_on(mesh)[0] is not None:
            self._refuse_keywords(kwargs)
        leaves, treedef = _flatten_arguments(args, kwargs)
        leaf_types = tuple(map(type, leaves))
        positions = _node_positions(leaf_types)
        nodes = tuple(map(leaves.__getitem__, positions))
        key: tuple[Any, ...] = (
            treedef,
            static_key(statics),
            leaf_types,
            tuple(map(id, nodes)),
            mesh,
        )
        passed = self._passed.get(treedef) if self._passed else None
        if passed:
            key += tuple(_pass_key(leaves[i]) for i in passed)
        call = _Call(leaves, nodes)
        try:
            layout = self._layouts.get(key) if modes.fast_paths else None
        except TypeError:  # an unhashable value passed through: _Layout names it
            layout = None
        if layout is None or not layout.split.unchanged():
            layout = _Layout(self, args, kwargs, call, treedef, statics, mesh)
            self._layouts.put(key, layout, call.nodes)
            if layout.passed:
                self._passed[treedef] = passed = tuple(layout.passed)
        repeatable = not (kwargs or statics or passed) and treedef is _flat_treedef(len(args))
        self._last = _Repeat.of(args, positions, mesh, layout) if repeatable else None
        return layout, call

    def _refuse_keywords(self, kwargs: dict) -> None:
        """Refuse dynamic keyword arguments next to specs, as `jax.jit` does."""
        raise ValueError(
            f"{self.fun_name} was called with the keyword argument(s) {', '.join(sorted(kwargs))}"
            f" while {self.in_name} is given: as jax.jit does not support kwargs when "
            f"in_shardings is specified, keyword arguments cannot take specs. Pass them "
            f"positionally (with a spec each), or mark them static (static_argnames)"
        )

    def _call_site_mesh(self) -> Any:
        """`mesh=` if given (called, if it is a function), else the `ml.use_mesh` mesh."""
        if self.mesh is None:
            return current_mesh()
        if isinstance(self.mesh, Mesh | AbstractMesh):
            return self.mesh
        return self.mesh()

    def _stage(self, key: Hashable, make_pure: Callable[[], Any], spec: StageSpec) -> Any:
        """The staged function for `key`, staged by the backend the first time."""
        staged = self._staged.get(key)
        if staged is None:
            try:
                staged = self.backend.stage(make_pure(), spec)
            except Exception as error:
                origin = self.backend.distribution or "registered in this process"
                error.add_note(
                    f"raised while backend {self.backend.name!r} ({origin}) staged {self.fun_name}"
                )
                raise
            self._staged[key] = staged
        return staged


class _BoundLifted:
    """A Lifted accessed as a method: the instance is passed as the first argument."""

    def __init__(self, lifted: Lifted, obj: Any):
        self._lifted, self._obj = lifted, obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted(self._obj, *args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.trace(self._obj, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.lower(self._obj, *args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.eval_shape(self._obj, *args, **kwargs)


class _Call:
    """One call's argument leaves (graph nodes are leaves) and its graph nodes.

    `fixed_structure`: made by `nnx.cached_partial`, whose nodes are copies of the
    caller's sharing its Variables, so only new values can reach the caller.
    """

    __slots__ = ("fixed_structure", "leaves", "nodes")

    def __init__(self, leaves: list[Any], nodes: tuple[Any, ...], fixed_structure: bool = False):
        self.leaves, self.nodes, self.fixed_structure = leaves, nodes, fixed_structure

    @classmethod
    def of_arguments(cls, args: tuple, positions: tuple[int, ...], fixed: bool = False) -> _Call:
        """The call of arguments that are all leaves, graph nodes at `positions`."""
        return cls(list(args), tuple(map(args.__getitem__, positions)), fixed)


class _Repeat:
    """A call whose arguments are all graph nodes or arrays, and its layout: the next call
    with arguments of the same types, the same nodes and the same mesh has the same key,
    so it skips the flatten and the lookup. Nodes are held weakly, as the cache holds them.
    """

    __slots__ = ("layout", "mesh", "positions", "refs", "types")

    def __init__(
        self,
        types: tuple[type, ...],
        positions: tuple[int, ...],
        refs: tuple,
        mesh: Any,
        layout: _Layout,
    ):
        self.types = types
        self.positions = positions
        self.refs = refs  # weak references to the nodes at `positions`
        self.mesh = mesh
        self.layout = layout

    @classmethod
    def of(
        cls, args: tuple, positions: tuple[int, ...], mesh: Any, layout: _Layout
    ) -> _Repeat | None:
        try:
            refs = tuple(weakref.ref(args[i]) for i in positions)
        except TypeError:  # a node that takes no weak reference
            return None
        return cls(tuple(map(type, args)), positions, refs, mesh, layout)

    def matches(self, args: tuple) -> bool:
        nodes = map(args.__getitem__, self.positions)
        return tuple(map(type, args)) == self.types and all(
            map(operator.is_, nodes, map(operator.call, self.refs))
        )


class _LayoutCache:
    """The last few layouts; a layout is forgotten as soon as one of its nodes is collected."""

    def __init__(self) -> None:
        self._items: collections.OrderedDict[Hashable, tuple[_Layout, list]] = (
            collections.OrderedDict()
        )

    def get(self, key: Hashable) -> _Layout | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)  # least recently used goes first
        return item[0]

    def put(self, key: Hashable, layout: _Layout, nodes: tuple[Any, ...]) -> None:
        forget = functools.partial(_forget, weakref.ref(self), key)
        guards = []
        for node in nodes:
            with contextlib.suppress(TypeError):  # a Variable passed directly: held until evicted
                guards.append(weakref.ref(node, forget))
        self._items[key] = (layout, guards)
        if len(self._items) > _MAX_LAYOUTS:
            self._items.popitem(last=False)


def _forget(cache_ref: Any, key: Hashable, _: Any) -> None:
    cache = cache_ref()
    if cache is not None:
        cache._items.pop(key, None)


class _TraceInfo:
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
        self.pick_changed = _picker(changed)  # their values out of the staged output
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


@jax.tree_util.register_pytree_node_class
class _Aux:
    """A childless output node carrying a _TraceInfo through jax's output treedef."""

    __slots__ = ("info",)

    def __init__(self, info: _TraceInfo):
        self.info = info

    def tree_flatten(self) -> tuple[tuple[()], _TraceInfo]:
        return (), self.info

    @classmethod
    def tree_unflatten(cls, info: _TraceInfo, _: Any) -> _Aux:
        return cls(info)


class PureFunction:
    """The function handed to a backend: arrays in, arrays out, no reference to a caller's object.

    Takes four tuples (kept Variables, kept other leaves, donated Variables,
    donated other leaves) and returns `(variables, extra, output, aux)`: one
    entry per Variable of the split (`None` where tracing found it unchanged),
    the leaves of Variables the function created (on a graph update), the
    output with graph nodes replaced by their arrays, and an `_Aux`.
    """

    def __init__(self, lifted: Lifted, layout: _Layout):
        self.fun_ref = _weak(lifted.fun)  # the cache of staged functions must not keep it
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
        out_specs = lifted.specs_on(layout.mesh)[1]
        self.out_container = type(out_specs) if type(out_specs) in (list, tuple) else None
        self.__name__ = getattr(lifted.fun, "__name__", "lifted")
        self.__qualname__ = getattr(lifted.fun, "__qualname__", self.__name__)

    def __call__(self, kept_vars, kept_dyn, donated_vars, donated_dyn):
        values: list[Any] = [None] * len(self.var_order)
        for i, value in zip(self.var_order, (*kept_vars, *donated_vars), strict=True):
            values[i] = value
        rebuilt = Rebuilt(self.graphdef, values)
        leaves: list[Any] = [None] * (len(self.node_pos) + len(self.dyn_order) + len(self.passed))
        for i, node in zip(self.node_pos, rebuilt.nodes, strict=True):
            leaves[i] = node
        for i, value in self.passed.items():
            leaves[i] = value
        for i, value in zip(self.dyn_order, (*kept_dyn, *donated_dyn), strict=True):
            leaves[i] = value
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        fun = self.fun_ref()
        statics = StaticValues(rebuilt.nodes)  # the caller's own objects, shared by the trace
        try:
            out = fun(*insert_statics(args, self.statics), **kwargs, **named_statics(self.statics))
        finally:
            changed_in_place = statics.changed()
            undone = not changed_in_place or statics.restore()
        if changed_in_place:
            self._refuse_static_changes(changed_in_place, undone)

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
            changed, var_out = (), tuple(var_list)
        container = type(out)
        if container in (list, tuple) and self.out_container not in (None, container):
            out = self.out_container(out)  # a list of specs matches a tuple output, and back
        user_out, outputs = encode_outputs(out, ref_index)
        info = _TraceInfo(
            changed,
            update,
            outputs,
            container if type(out) is not container else None,
            self.graphdef,
        )
        return var_out, tuple(extra), user_out, _Aux(info)

    def _refuse_static_changes(self, paths: list[Path], undone: bool) -> None:
        shown = listing(format_path((self.names[p[0]], *p[1:])) for p in paths)  # type: ignore[call-overload]
        raise StructureChangedError(
            f"{self.__name__} changed {shown} in place. Static values are compiled into the "
            f"program, and JAX runs the function's Python once per compile: later calls would "
            f"run without the change. "
            + ("It was undone and nothing" if undone else "It could not be undone; nothing else")
            + " was written back. Assign a new value instead (`model.cfg = Config(...)`), or "
            "change it outside the lifted function."
        )


class _Layout:
    """Everything fixed for one argument layout: the split, the shardings, the staged function."""

    def __init__(
        self,
        lifted: Lifted,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: _Call,
        treedef: Any,
        statics: tuple[Any, ...],
        mesh: Any,
    ):
        self.lifted, self.treedef, self.statics, self.mesh = lifted, treedef, statics, mesh
        self.arg_count, self.kwarg_names = len(args), tuple(kwargs)
        leaves = call.leaves
        self.node_pos = tuple(i for i, leaf in enumerate(leaves) if is_graph_leaf(leaf))
        self.dyn_pos = tuple(i for i, leaf in enumerate(leaves) if not is_graph_leaf(leaf))
        sig = lifted.signature
        self.leaf_paths = sig.leaf_paths(args, kwargs, statics)
        names = [format_path(self.leaf_paths[i]) for i in self.node_pos]
        self.split = GraphSplit(call.nodes, names)
        donated = sig.donated_leaves(args, kwargs, statics)
        if any(donated) and any(compat.is_ref(raw(leaf)) for leaf in self.split.leaves):
            donated = [False] * len(donated)  # XLA cannot alias both: see _REF_DONATION
            warnings.warn(_REF_DONATION.format(lifted.fun_name), UserWarning, stacklevel=4)
        self.var_shardings, self.dyn_shardings = self._in_shardings(args, leaves)
        dyn_shardings = self.dyn_shardings
        passes = lifted.backend.passes_through_none
        self.passed = {  # leaf position -> a value handed to the function unchanged
            i: leaves[i]
            for i in self.dyn_pos
            if passes and dyn_shardings[i] is None and _pass_key(leaves[i]) is not _ARRAY
        }
        if self.passed:
            self.dyn_pos = tuple(i for i in self.dyn_pos if i not in self.passed)
        passed = tuple((i, _pass_key(leaves[i])) for i in self.passed)
        self._check_hashable(passed)

        var_donated = [donated[self.node_pos[_top(path)]] for path in self.split.paths]
        self.var_groups = _partition(range(len(self.var_shardings)), var_donated)
        self.dyn_groups = _partition(self.dyn_pos, [donated[i] for i in self.dyn_pos])
        self._pick_dyn = _picker(self.dyn_pos)
        self.donated = bool(self.var_groups[1] or self.dyn_groups[1])
        in_shardings = (
            tuple(self.var_shardings[i] for i in self.var_groups[0]),
            tuple(dyn_shardings[i] for i in self.dyn_groups[0]),
            tuple(self.var_shardings[i] for i in self.var_groups[1]),
            tuple(dyn_shardings[i] for i in self.dyn_groups[1]),
        )
        donate_argnums = (2, 3) if self.donated else ()
        # Everything the pure function is made of besides its arrays: where the graph nodes
        # sit, which leaves are donated, static values by type; never an identity.
        key = (
            self.split.key,
            treedef,
            static_key(statics),
            self.node_pos,
            self.var_groups,
            self.dyn_groups,
            in_shardings,
            donate_argnums,
            mesh,
            passed,
        )
        if key not in lifted._staged:
            out_shardings = (self.var_shardings, None, self._out_shardings(call), None)
            spec = StageSpec(
                in_specs=in_shardings,
                out_specs=out_shardings,
                mesh=mesh,
                donate_argnums=donate_argnums,
                options=lifted.options,
            )
            self.staged = lifted._stage(key, lambda: PureFunction(lifted, self), spec)
        else:
            self.staged = lifted._staged[key]
        self.placed = False
        self.info: _TraceInfo | None = None  # what the last successful call's trace found

    def _check_hashable(self, passed: tuple[tuple[int, Any], ...]) -> None:
        for i, value in passed:
            try:
                hash(value)
            except TypeError as e:
                raise TypeError(
                    f"`{format_path(self.leaf_paths[i])}` ({type(value[1]).__name__}) passes "
                    f"through {self.lifted.fun_name} unchanged (its spec is None and it is not "
                    f"an array), so it is compiled in like a static argument and must be "
                    f"hashable; pass a tuple or a frozen dataclass, or an array with a spec"
                ) from e

    # -- per call -------------------------------------------------------------------------
    def inputs(self, values: Sequence[Any], call: _Call) -> tuple[tuple[Any, ...], ...]:
        """The staged function's four arguments."""
        leaves = call.leaves
        if not self.donated:
            return tuple(values), self._pick_dyn(leaves), (), ()
        return (
            tuple(values[i] for i in self.var_groups[0]),
            tuple(leaves[i] for i in self.dyn_groups[0]),
            tuple(values[i] for i in self.var_groups[1]),
            tuple(leaves[i] for i in self.dyn_groups[1]),
        )

    def placed_inputs(self, call: _Call) -> tuple[tuple[Any, ...], ...]:
        """The inputs with every Variable on its planned sharding, written nowhere (for stages)."""
        self._refuse_misplaced_leaves(call)
        values = self.split.gather()
        return self.inputs(_onto(values, self.var_shardings) or values, call)

    def run(self, staged: Any, call: _Call) -> Any:
        """Call `staged`; then, all or nothing, write back and rebuild graph nodes in the output.

        The first call of a layout also places Variables onto the plan, once it
        has succeeded.
        """
        values = self.split.gather()
        placed = None if self.placed else _onto(values, self.var_shardings)
        inputs = self.inputs(placed or values, call)
        if self.donated:
            self._refuse_shared_donation(inputs)
        try:
            outputs = staged(*inputs)
        except Exception as error:
            return self.recover(error, staged, values, placed, call)
        return self.finish(outputs, values, placed, call)

    def recover(
        self,
        error: Exception,
        staged: Any,
        values: Sequence[Any],
        placed: Sequence[Any] | None,
        call: _Call,
    ) -> Any:
        """`staged` raised `error` on `values` (or `placed`): the output of the call made
        again if a Variable was given an array on another sharding since (JAX refuses
        those; it is moved back to the plan's), else `error` raised with the caller's
        names. Any other argument JAX refuses is named in the error, never moved."""
        try:
            if not isinstance(error, ValueError):
                raise error
            self._refuse_misplaced_leaves(call)
            moved = _onto(placed or values, self.var_shardings)
            if moved is None:
                raise error
            outputs = staged(*self.inputs(moved, call))
        except Exception as final:
            self.rename_staged(final)
            if self.donated:
                self._note_consumed(final, values)
            self._name_indivisible(final, call)
            raise
        return self.finish(outputs, values, moved, call)

    def finish(
        self, outputs: Any, values: Sequence[Any], placed: Sequence[Any] | None, call: _Call
    ) -> Any:
        """Write the staged `outputs` back (the arguments held `values`, `placed` if moved
        onto the plan) and give the caller's output."""
        var_out, extra, user_out, aux = outputs
        info = aux.info
        statics = info.statics(self.split)
        index_map = self._write_back(info, values, placed, var_out, extra, call, statics)
        self.placed = True
        self.info = info
        return info.decode(user_out, index_map, statics)

    def _refuse_shared_donation(self, inputs: tuple[tuple[Any, ...], ...]) -> None:
        """Refuse, naming both, a donated array that another input holds too (two Params
        of one array, say): JAX cannot donate a buffer twice, nor read one it donated."""
        if speedups.donated_alone(inputs):
            return
        kept_vars, kept_dyn, donated_vars, donated_dyn = inputs
        donated = [*donated_vars, *donated_dyn]
        ids = set(map(id, donated))
        var_name = [format_path(self._variable_path(i)) for i in range(len(self.split.paths))]
        dyn_name = {i: format_path(self.leaf_paths[i]) for i in self.dyn_pos}
        (kept_var_pos, donated_var_pos), (kept_dyn_pos, donated_dyn_pos) = (
            self.var_groups,
            self.dyn_groups,
        )
        names = [
            *map(var_name.__getitem__, kept_var_pos),
            *map(dyn_name.__getitem__, kept_dyn_pos),
            *map(var_name.__getitem__, donated_var_pos),
            *map(dyn_name.__getitem__, donated_dyn_pos),
        ]
        first: dict[int, str] = {}
        for name, value in zip(names, (*kept_vars, *kept_dyn, *donated), strict=True):
            if isinstance(value, jax.Array) and id(value) in first and id(value) in ids:
                raise ValueError(
                    f"`{first[id(value)]}` and `{name}` hold the same array, and it is donated "
                    f"to {self.lifted.fun_name} (shape {value.shape}): JAX cannot donate one "
                    f"buffer twice or read a buffer it donated. Give one of them its own copy "
                    f"(`jnp.copy`), or do not donate it. Nothing was changed."
                )
            first.setdefault(id(value), name)

    def _refuse_misplaced_leaves(self, call: _Call) -> None:
        """Refuse, naming it, an argument array committed to a sharding other than its spec's
        (`jax.jit` refuses it too; meshlift does not move the caller's arrays)."""
        for pos in self.dyn_pos:
            leaf, sharding = call.leaves[pos], self.dyn_shardings[pos]
            if (
                sharding is None
                or not isinstance(leaf, jax.Array)
                or isinstance(leaf, jax.core.Tracer)
                or not compat.is_committed(leaf)
                or leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
            ):
                continue
            spec = getattr(sharding, "spec", sharding)
            mesh = resolve.mesh_shape(getattr(sharding, "mesh", None))
            raise ValueError(
                f"`{format_path(self.leaf_paths[pos])}` (shape {leaf.shape}) is committed to "
                f"{leaf.sharding}, but {self.lifted.in_name} gives it {spec} on mesh {mesh}. "
                f"JAX refuses an argument laid out otherwise, and meshlift does not move your "
                f"arrays: put it there first (`jax.device_put(x, NamedSharding(mesh, {spec}))`), "
                f"or change its spec"
            )

    @contextlib.contextmanager
    def named_errors(self, call: _Call | None = None) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            self.rename_staged(error)
            self._name_indivisible(error, call)
            raise

    def _name_indivisible(self, error: BaseException, call: _Call | None) -> None:
        """JAX found a sharding that does not divide a shape, without saying whose: raise a
        PlanError naming the argument or output (a Variable whose shape changed since its
        plan was resolved, an output spec that does not fit). Without this call's leaves
        (`call` None) only the Variables are looked at."""
        if not isinstance(error, ValueError) or "evenly divide" not in str(error):
            return
        in_name, mesh = self.lifted.in_name, self.mesh
        try:
            values = self.split.gather()
            for i, (value, sharding) in enumerate(zip(values, self.var_shardings, strict=True)):
                path = format_path(self._variable_path(i))
                resolve.to_sharding(sharding, mesh, path, value, in_name)
            if call is None:
                return
            for pos, sharding in self.dyn_shardings.items():
                path = format_path(self.leaf_paths[pos])
                resolve.to_sharding(sharding, mesh, path, call.leaves[pos], in_name)
            out_specs = self.lifted.specs_on(mesh)[1]
            abstract_out, info = self._abstract_outputs(PureFunction(self.lifted, self), call)
            resolve.output_shardings(
                out_specs, abstract_out, info.outputs, mesh, self.lifted.out_name
            )
        except PlanError as named:
            raise named from error
        except Exception:  # the explanation failed: JAX's own error stands
            return

    def rename_staged(self, error: BaseException) -> None:
        """Put the caller's names in a JAX error that names the staged function's inputs
        (`kept_dyn[0]`) or output specs (`out_specs[0][3]`)."""
        if len(error.args) != 1 or not isinstance(error.args[0], str):
            return
        text = _STAGED_INPUT.sub(self._input_name, error.args[0])
        text = _STAGED_OUTPUT.sub(self._output_name, text)
        text = text.replace("the function <unknown>", f"the function {self.lifted.fun_name}")
        error.args = (text,)

    def _input_name(self, match: re.Match[str]) -> str:
        group, j = _INPUT_GROUPS[match.group(1)], int(match.group(2))
        positions = (self.var_groups, self.dyn_groups)[group % 2][group // 2]
        if j >= len(positions):
            return match.group(0)
        if group % 2 == 0:
            return f"`{format_path(self._variable_path(positions[j]))}`"
        return f"`{format_path(self.leaf_paths[positions[j]])}`"

    def _output_name(self, match: re.Match[str]) -> str:
        """`[0][i]`: the Variable at split position i; `[2]...`: the caller's output."""
        where, *rest = (int(i) for i in re.findall(r"\d+", match.group(2)))
        if where == 0 and len(rest) == 1 and rest[0] < len(self.split.paths):
            return f"the Variable `{format_path(self._variable_path(rest[0]))}` (written back)"
        if where == 2:
            return f"{self.lifted.out_name} for `{format_path(('output', *map(str, rest)))}`"
        return match.group(0)

    def _write_back(
        self,
        info: _TraceInfo,
        values: Sequence[Any],
        placed: Sequence[Any] | None,
        var_out: Sequence[Any],
        extra: Sequence[Any],
        call: _Call,
        statics: StaticObjects,
    ) -> Any:
        """Validate every write, then make them (the caller's `statics` in a new graph); the
        index map to decode outputs with."""
        split = self.split
        if info.update is not None and call.fixed_structure:
            raise StructureChangedError(
                f"{self.lifted.fun_name} changed the structure of its arguments (a new, "
                f"replaced or deleted attribute) under nnx.cached_partial, which keeps the "
                f"structure it was given, as under nnx.jit: nothing was written back. Change "
                f"only values there, or call the lifted function without cached_partial."
            )
        if info.update is not None:
            leaves = info.update.leaves(var_out, extra)
            self._check_no_leak(leaves, info.update.sources, info.update.paths)
            index_map = info.update.apply(leaves, split.index_map(call.nodes), statics)
            if placed is not None:  # a reference placed anew was updated through: keep it
                moved = [i for i, value in enumerate(values) if placed[i] is not value]
                refs = [i for i in moved if compat.is_ref(values[i])]
                split.scatter(refs, [placed[i] for i in refs], call.nodes)
            return index_map
        if placed is None:
            positions, new = info.changed, info.pick_changed(var_out)
        else:
            writes = dict.fromkeys(info.changed)
            writes.update(
                (i, None) for i, (a, b) in enumerate(zip(placed, values, strict=True)) if a is not b
            )
            positions = tuple(writes)
            changed = frozenset(info.changed)
            new = tuple(var_out[i] if i in changed else placed[i] for i in positions)
        if positions:
            self._check_no_leak(new, positions)
            split.scatter(positions, new, call.nodes)
        return split.index_map(call.nodes) if info.outputs.graphdefs else None

    def _check_no_leak(
        self,
        new: Sequence[Any],
        positions: Sequence[int | None],
        new_paths: Sequence[Path] | None = None,
    ) -> None:
        """Refuse to put an outer transform's tracers into Variables that live outside it.

        `positions[j]` is the split position `new[j]` goes to; None for a leaf made
        inside (at `new_paths[j]`), outside if the caller's nodes are.
        """
        if compat.outside_traces():  # then no output is a tracer
            return
        tracer = jax.core.Tracer
        if not any(map(isinstance, new, itertools.repeat(tracer))):
            return
        leaves = self.split.leaves
        traced = [j for j, value in enumerate(new) if isinstance(value, tracer)]
        model_outside = not all(map(_updatable, leaves))
        outside = [
            self._caller_path(self.split.paths[i] if i is not None else new_paths[j])  # type: ignore[index]
            for j in traced
            if ((i := positions[j]) is None and model_outside)
            or (i is not None and not _updatable(leaves[i]))
        ]
        if outside:
            shown = listing(format_path(path) for path in outside)
            raise TraceLeakError(
                f"{self.lifted.fun_name} was called inside an outer JAX transform (jax.jit, "
                f"lax.scan, jax.grad, jax.vmap...) and would write that transform's tracers "
                f"into {shown}, which live outside it. Nothing was written. Pass the "
                f"model through the outer transform (nnx.jit, nnx.scan, nnx.grad, nnx.vmap, or "
                f"nnx.split/nnx.merge around jax.jit) so its state flows through it, or call "
                f"{self.lifted.fun_name} outside the transform."
            )

    def _note_consumed(self, error: Exception, values: Sequence[Any]) -> None:
        """Name the caller's Variables whose donated arrays a failed call deleted."""
        deleted = [i for i, v in enumerate(values) if _is_deleted(v)]
        if deleted:
            names = [format_path(self._variable_path(i)) for i in deleted]
            error.add_note(
                f"{self.lifted.fun_name} failed after its donated arrays were given to the "
                f"computation: {listing(names)} now hold deleted arrays, as under jax.jit. "
                f"Restore them (from a checkpoint or a copy) before using the model again."
            )

    def _variable_path(self, i: int) -> Path:
        return self._caller_path(self.split.paths[i])

    def _caller_path(self, path: Path) -> Path:
        """A split path (top-level node position first) in the caller's argument names."""
        return (*self.leaf_paths[self.node_pos[_top(path)]], *path[1:])

    # -- stages in the caller's terms -------------------------------------------------------
    def as_arguments(self, tree: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A tree over the staged inputs (avals, shardings...) as the caller's `(args,
        kwargs)`, static ones left out, each graph node an `nnx.State` by Variable path."""
        kept_vars, kept_dyn, donated_vars, donated_dyn = tree[0]
        variables = self.var_groups[0] + self.var_groups[1]
        per_variable = dict(zip(variables, (*kept_vars, *donated_vars), strict=True))
        others = self.dyn_groups[0] + self.dyn_groups[1]
        leaves = dict(zip(others, (*kept_dyn, *donated_dyn), strict=True)) | self.passed
        for k, pos in enumerate(self.node_pos):
            paths = self.split.paths
            leaves[pos] = _as_state(
                {p[1:]: per_variable[i] for i, p in enumerate(paths) if p[0] == k}
            )
        return jax.tree.unflatten(self.treedef, [leaves[i] for i in range(len(leaves))])

    @staticmethod
    def as_output(tree: Any) -> Any:
        """A tree over the staged outputs as the caller's output, graph nodes as `nnx.State`."""
        _, _, user_out, aux = tree
        info = aux.info
        nodes = info.outputs
        if nodes.graphdefs:
            items = nodes.treedef.flatten_up_to(user_out)
            for i, paths in nodes.paths.items():
                items[i] = _as_state(dict(zip(paths, items[i], strict=True)))
            user_out = nodes.treedef.unflatten(items)
        return user_out if info.container is None else info.container(user_out)

    def eval_shape(self, call: _Call) -> Any:
        return self._abstract_outputs(self.staged, call)[0]

    def _abstract_outputs(self, fun: Callable[..., Any], call: _Call) -> tuple[Any, _TraceInfo]:
        """`fun`'s output, graph nodes rebuilt as abstract modules, and what tracing found."""
        values = [_abstract(v) for v in self.split.gather()]
        evaluate = getattr(fun, "eval_shape", None) or functools.partial(jax.eval_shape, fun)
        var_out, extra, user_out, aux = evaluate(*self.inputs(values, call))
        info = aux.info
        index_map = abstract_index_map(self.split.graphdef, values)
        statics = info.statics(self.split)
        if info.update is not None:
            index_map = info.update.apply(info.update.leaves(var_out, extra), index_map, statics)
        return info.decode(user_out, index_map, statics), info

    # -- plan resolution --------------------------------------------------------------------
    def _in_shardings(
        self, args: tuple[Any, ...], leaves: list[Any]
    ) -> tuple[tuple[Sharding | None, ...], dict[int, Sharding | None]]:
        """One sharding per Variable (split order) and per other leaf (by leaf position)."""
        lifted = self.lifted
        positional = lifted.signature.positional_prefix(
            lifted.specs_on(self.mesh)[0], args, lifted.in_name, lifted.fun_name
        )
        prefix = resolve.broadcast_prefix(positional, args, lifted.in_name, "arguments")
        prefix += [None] * (len(leaves) - len(prefix))  # keyword arguments: given no specs
        split = self.split
        position: dict[Any, int] = {  # a Variable by identity; an array by where it is stored
            id(v) if isinstance(v, nnx.Variable) else p: i
            for i, (p, v) in enumerate(zip(split.paths, split.leaves, strict=True))
        }
        node_specs = [
            (format_path(self.leaf_paths[pos]), leaves[pos], prefix[pos]) for pos in self.node_pos
        ]
        var_shardings = resolve.variable_shardings(
            node_specs, position, len(split.leaves), self.mesh, lifted.in_name
        )
        dyn_shardings = {
            pos: resolve.leaf_sharding(
                prefix[pos], self.leaf_paths[pos], leaves[pos], self.mesh, lifted.in_name
            )
            for pos in self.dyn_pos
        }
        return var_shardings, dyn_shardings

    def _out_shardings(self, call: _Call) -> Any:
        """The output's shardings; a plan for output modules is resolved on an abstract trace."""
        lifted = self.lifted
        out_specs = lifted.specs_on(self.mesh)[1]
        if not any(isinstance(s, StateSharding | Mapping) for s in resolve.spec_leaves(out_specs)):
            return resolve.simple_shardings(out_specs, self.mesh, lifted.out_name)
        try:
            abstract_out, info = self._abstract_outputs(PureFunction(lifted, self), call)
        except Exception as e:
            self.rename_staged(e)
            raise PlanError(
                f"{lifted.out_name} holds a StateSharding, which meshlift resolves by tracing "
                f"{lifted.fun_name} abstractly, outside the {lifted.backend.name} backend; that "
                f"trace failed ({type(e).__name__}: {e}). Give {lifted.out_name} as "
                f"PartitionSpecs for this function."
            ) from e
        return resolve.output_shardings(
            out_specs, abstract_out, info.outputs, self.mesh, lifted.out_name
        )


@overload
def transform(
    backend: str | Backend,
    fun: Callable[Params, Result],
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    **options: Any,
) -> Lifted[Params, Result]: ...


@overload
def transform(
    backend: str | Backend,
    fun: None = None,
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    **options: Any,
) -> Callable[[Callable[Params, Result]], Lifted[Params, Result]]: ...


def transform(
    backend: str | Backend,
    fun: Callable[..., Any] | None = None,
    /,
    *,
    mesh: MeshLike = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    **options: Any,
) -> Any:
    """Lift `fun` with any backend, by name or object, using the unified argument names.

    `in_specs`/`out_specs` are pytree prefixes of the positional arguments
    and the output, with `PartitionSpec`, `NamedSharding`, `None` or
    `StateSharding` leaves. Other keyword options go to the backend.

    Example:

    ```python
    import optax

    mesh = ml.make_mesh({"data": 2, "model": 4})
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(batch) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    step = ml.transform("jit", train_step, mesh=mesh, in_specs=(plan, plan, P("data")),
                        out_specs=P())
    loss = step(model, optimizer, jnp.ones((8, 16)))
    ```
    """
    kwargs = dict(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        options=options,
    )
    backend = get_backend(backend)
    if backend.unify is not None:
        kwargs = backend.unify(kwargs)
    kwargs.setdefault("spec_names", backend.spec_names)
    if fun is None:
        return lambda f: Lifted(f, backend, **kwargs)
    return Lifted(fun, backend, **kwargs)


# -- helpers -----------------------------------------------------------------------------

# fun -> options key -> staged key -> staged function; an entry goes with its function
_STAGES: weakref.WeakKeyDictionary[Any, dict[Hashable, dict[Hashable, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _shared_stages(fun: Callable[..., Any], options_key: Hashable | None) -> dict[Hashable, Any]:
    """The staged functions of every `Lifted` of `fun` with these options."""
    if options_key is None:
        return {}
    try:
        return _STAGES.setdefault(fun, {}).setdefault(options_key, {})
    except TypeError:  # a function that cannot be weakly referenced or hashed
        return {}


def _spec_key(specs: Any) -> Hashable:
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: is_spec(x) or x is None)
    return treedef, tuple(leaves)


def _graph_receiver(fun: Callable[..., Any]) -> Any:
    """The graph node a bound method `fun` belongs to (it is lifted as an argument, read
    afresh at each call, never captured), else None."""
    receiver = getattr(fun, "__self__", None)
    if isinstance(fun, types.MethodType) and is_graph_leaf(receiver):
        return receiver
    return None


def _after_receiver(
    static_argnums: Any, static_argnames: Any, donate_argnums: Any, donate_argnames: Any
) -> tuple[Any, Any, Any, Any]:
    """The argument options of a bound method for its function, the receiver first."""

    def shifted(nums: Any) -> Any:
        if nums is None:
            return None
        nums = (nums,) if isinstance(nums, int) else tuple(nums)
        return tuple(i + 1 if i >= 0 else i for i in nums)

    return shifted(static_argnums), static_argnames, shifted(donate_argnums), donate_argnames


def _with_receiver_spec(in_specs: Any, meshless_specs: Any) -> tuple[Any, Any]:
    """Specs of a bound method's arguments, with `None` (unspecified) for the receiver
    where they are given per argument."""

    def prepended(specs: Any) -> Any:
        return (None, *specs) if isinstance(specs, tuple | list) else specs

    if meshless_specs is not None:
        meshless_specs = (prepended(meshless_specs[0]), meshless_specs[1])
    return prepended(in_specs), meshless_specs


def _checked_specs(specs: Any, what: str) -> Any:
    """Refuse a graph node given where specs go, when the function is lifted."""
    node = next((s for s in resolve.spec_leaves(specs) if is_graph_leaf(s)), None)
    if node is not None:
        raise PlanError(
            f"{what} contains a {type(node).__name__}, a graph node, where specs go; give a "
            f"StateSharding (or an nnx.State / nested dict of PartitionSpecs) instead"
        )
    return specs


def _picker(positions: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function taking the items at `positions` out of a sequence, as a tuple."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda items: (items[i],)
    return lambda items: ()


def _flatten_arguments(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """`jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)`, without a Python callback
    per argument when each is a graph node or an array, as in a training loop's calls."""
    if not kwargs and all(map(_is_top_level_leaf, map(type, args))):
        return list(args), _flat_treedef(len(args))
    return jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)


@per_type
def _is_top_level_leaf(cls: type) -> bool:
    return is_graph_type(cls) or issubclass(cls, jax.Array)


@functools.lru_cache(maxsize=64)
def _flat_treedef(count: int) -> Any:
    """The tree structure of `((leaf,) * count, {})`."""
    return jax.tree.structure(((0,) * count, {}))


@functools.lru_cache(maxsize=256)
def _node_positions(types: tuple[type, ...]) -> tuple[int, ...]:
    """Where the graph nodes are among leaves of these types (cached: on the per-call path)."""
    return tuple(i for i, cls in enumerate(types) if is_graph_type(cls))


def _updatable(leaf: Any) -> bool:
    """Whether `leaf` may take a value of the current trace: a Variable flax lets update,
    or an array stored on a module that is itself a tracer (the module lives in the trace)."""
    if hasattr(leaf, "get_raw_value"):  # a Variable
        return compat.can_update(leaf)
    return isinstance(leaf, jax.core.Tracer)


def _partition(items: Iterable[int], flags: list[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    items = list(items)
    return (
        tuple(i for i, f in zip(items, flags, strict=True) if not f),
        tuple(i for i, f in zip(items, flags, strict=True) if f),
    )


def _onto(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any] | None:
    """`values` with each array not on its sharding moved there; None if none had to move.

    Tracers (an outer trace) are never moved: they are not the caller's arrays.
    """
    misplaced = [
        i
        for i, (value, sharding) in enumerate(zip(values, shardings, strict=True))
        if sharding is not None
        and not isinstance(value, jax.core.Tracer)
        and getattr(value, "sharding", sharding) != sharding
    ]
    if not misplaced:
        return None
    # One array held twice and placed alike is moved once, and stays one array.
    first = {(id(values[i]), shardings[i]): i for i in reversed(misplaced)}
    unique = sorted(first.values())
    arrays = [values[i][...] if compat.is_ref(values[i]) else values[i] for i in unique]
    moved = jax.device_put(arrays, [shardings[i] for i in unique])
    if isinstance(moved[0], jax.core.Tracer):  # device_put was staged into an outer trace
        return None
    placed_once = {  # a reference: a new one, placed
        i: compat.new_ref(value) if compat.is_ref(values[i]) else value
        for i, value in zip(unique, map(_own_buffers, moved, arrays), strict=True)
    }
    placed = list(values)
    for i in misplaced:
        placed[i] = placed_once[first[id(values[i]), shardings[i]]]
    return placed


def _own_buffers(moved: jax.Array, source: jax.Array) -> jax.Array:
    """`moved` (`source` put onto a sharding), moved again from a copy of `source` if it
    shares a buffer with it: `jax.device_put` reuses the source's buffer for a replica on
    its device (`may_alias=False` notwithstanding, jax 0.10). Another input may still
    hold `source`, and XLA cannot donate a buffer it also reads (jaxlib crashes)."""
    held = {shard.data.unsafe_buffer_pointer() for shard in source.addressable_shards}
    if all(shard.data.unsafe_buffer_pointer() not in held for shard in moved.addressable_shards):
        return moved
    return jax.device_put(jnp.copy(source), moved.sharding)


_ARRAY = object()  # _pass_key of an array: never passed through


def _pass_key(leaf: Any) -> Any:
    """What a leaf that may pass through is compiled in as: its type and value; _ARRAY for an
    array (always an input)."""
    if isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "__jax_array__"):
        return _ARRAY
    return type(leaf), leaf


def _weak(fun: Callable[..., Any]) -> Callable[[], Any]:
    """A weak reference to `fun`, or a strong one where it cannot be weakly referenced."""
    try:
        return weakref.ref(fun)
    except TypeError:
        return lambda: fun


def _top(path: Path) -> int:
    """The top-level node position a split path starts with."""
    top = path[0]
    assert isinstance(top, int)
    return top


def _as_state(flat: dict[Path, Any]) -> Any:
    """One graph node's entries by path as an `nnx.State` (a Variable passed alone: its entry)."""
    if list(flat) == [()]:
        return flat[()]
    return nnx.State.from_flat_path(flat)  # type: ignore[arg-type]  # paths of str and int


def _is_deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x
