"""The one lifted transform every backend shares.

``Lifted`` splits the arguments (graph nodes -> their Variables' arrays,
everything else -> pytree leaves), resolves the plan to one sharding per leaf,
hands a pure function over arrays to a backend, calls it, and writes updated
arrays back onto the caller's objects. A ``_Binding`` made once per argument
structure makes the per-call path short: gather arrays, call, scatter arrays.

Example::

    step = ml.transform("jit", train_step, mesh=mesh, in_specs=(plan, P("data")))
    loss = step(model, batch)       # model's parameters are updated in place
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib
from jax.sharding import AbstractMesh, Mesh, Sharding

from meshlift.backend import Backend, StageSpec
from meshlift.graph import (
    GraphSplit,
    StructureChangedError,
    fingerprint,
    is_graph_leaf,
    variable_paths,
)
from meshlift.mesh import current_mesh
from meshlift.plugins import get_backend
from meshlift.sharding import (
    PlanError,
    StateSharding,
    format_path,
    is_spec,
    key_name,
    to_sharding,
    value_shape,
)

_MAX_BINDINGS = 8  # argument structures remembered per lifted function


class _TraceInfo:
    """What tracing learned that the caller needs: changed Variables, output graph nodes."""

    def __init__(self, changed: tuple[int, ...], out_treedef: Any, graphdefs: dict, paths: dict):
        self.changed = changed
        self.out_treedef = out_treedef
        self.out_graphdefs = graphdefs  # output leaf position -> graphdef of a graph node
        self.out_paths = paths  # output leaf position -> paths of that node's new leaves


@jax.tree_util.register_pytree_node_class
class _Aux:
    """A childless output node carrying a _TraceInfo through jax's output treedef."""

    def __init__(self, info: _TraceInfo):
        self.info = info

    def tree_flatten(self) -> tuple[tuple[()], _TraceInfo]:
        return (), self.info

    @classmethod
    def tree_unflatten(cls, info: _TraceInfo, _: Any) -> _Aux:
        return cls(info)


class Lifted:
    """A function lifted over stateful arguments, staged by one backend.

    Made by ``ml.transform`` and by the backends' front ends (``ml.jit``).
    Calling it runs the staged function and writes updated Variables back;
    ``trace``, ``lower`` and ``eval_shape`` give JAX's stages, wrapped so that
    compiled objects are called with modules too.

    ``mesh`` is a mesh, a function returning one at each call (how a backend
    reads a call-site context), or None for the mesh of ``ml.use_mesh``.
    ``spec_names`` are the front end's names for the specs, used in errors.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        backend: str | Backend,
        *,
        in_specs: Any = None,
        out_specs: Any = None,
        mesh: Any = None,
        static_argnums: int | Iterable[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Iterable[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
        options: Mapping[str, Any] | None = None,
        spec_names: tuple[str, str] = ("in_specs", "out_specs"),
    ):
        if not callable(fun):
            raise TypeError(f"expected a function to lift, got {type(fun).__name__}: {fun!r}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.backend = get_backend(backend)
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        self.options = dict(options or {})
        self.in_name, self.out_name = spec_names
        self.param_names = _parameter_names(fun)
        self.static_argnums, self.static_argnames = _infer_argnums_and_argnames(
            self.param_names, static_argnums, static_argnames
        )
        self.donate_argnums, self.donate_argnames = _infer_argnums_and_argnames(
            self.param_names, donate_argnums, donate_argnames
        )
        self._bindings: collections.OrderedDict[Hashable, _Binding] = collections.OrderedDict()
        self._staged: dict[Hashable, Any] = {}

    def __repr__(self) -> str:
        return f"<meshlift.{self.backend.name} of {getattr(self.fun, '__qualname__', self.fun)}>"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else _BoundLifted(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding, leaves = self._bind(args, kwargs)
        return binding.run(binding.staged, binding.inputs(leaves))

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace for these arguments; ``.lower()`` continues. Nothing is written back."""
        binding, leaves = self._bind(args, kwargs)
        return Traced(binding.staged.trace(*binding.inputs(leaves)), binding)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for these arguments; ``.compile()`` gives a ``Compiled`` called like this function."""
        binding, leaves = self._bind(args, kwargs)
        return Lowered(binding.staged.lower(*binding.inputs(leaves)), binding)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """Output shapes and dtypes, graph outputs as abstract modules; nothing is written back."""
        binding, leaves = self._bind(args, kwargs)
        abstract_inputs = jax.tree.map(_abstract, binding.inputs(leaves))
        _, user_out, aux = jax.eval_shape(binding.staged, *abstract_inputs)
        return _decode_outputs(user_out, aux.info, binding.abstract_index_map())

    def _bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: Any = None
    ) -> tuple[_Binding, list[Any]]:
        """The binding for these arguments' structure (made if new or stale), and their leaves.

        ``mesh`` overrides the call-site lookup (a compiled object keeps its mesh).
        """
        statics: tuple[Any, ...] = ()
        if self.static_argnums or self.static_argnames:
            args, kwargs, statics = self._pop_statics(args, kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)
        node_ids = tuple(id(leaf) for leaf in leaves if is_graph_leaf(leaf))
        mesh = self._call_site_mesh() if mesh is None else mesh
        key = (treedef, statics, node_ids, mesh)
        binding = self._bindings.get(key)
        if binding is None or not binding.split.unchanged():
            binding = _Binding(self, args, kwargs, leaves, treedef, statics, mesh)
            self._bindings[key] = binding
            if len(self._bindings) > _MAX_BINDINGS:
                self._bindings.popitem(last=False)
        return binding, leaves

    def _call_site_mesh(self) -> Any:
        """``mesh=`` if given (called, if it is a function), else the ``ml.use_mesh`` mesh."""
        if self.mesh is None:
            return current_mesh()
        if isinstance(self.mesh, Mesh | AbstractMesh):
            return self.mesh
        return self.mesh()

    def _pop_statics(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
        nums = {i % len(args) for i in self.static_argnums if -len(args) <= i < len(args)}
        statics = tuple((i, args[i]) for i in sorted(nums))
        statics += tuple((k, kwargs[k]) for k in self.static_argnames if k in kwargs)
        for where, value in statics:
            try:
                hash(value)
            except TypeError as e:
                raise TypeError(
                    f"static argument {self._arg_name(where)} must be hashable, got "
                    f"{type(value).__name__}: {value!r}; pass a tuple or a frozen dataclass, "
                    f"or don't mark it static"
                ) from e
        args = tuple(a for i, a in enumerate(args) if i not in nums)
        kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return args, kwargs, statics

    def _arg_name(self, where: int | str) -> str:
        if isinstance(where, str):
            return where
        if where < len(self.param_names):
            return self.param_names[where]
        return f"args[{where}]"


class _BoundLifted:
    """A Lifted accessed as a method: the instance is passed as the first argument."""

    def __init__(self, lifted: Lifted, obj: Any):
        self._lifted, self._obj = lifted, obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted(self._obj, *args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        return self._lifted.trace(self._obj, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        return self._lifted.lower(self._obj, *args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._lifted.eval_shape(self._obj, *args, **kwargs)


class _Binding:
    """Everything fixed for one argument structure: the split, the shardings, the staged function.

    The pure function handed to the backend takes four tuples (kept Variables,
    kept other leaves, donated Variables, donated other leaves) and returns
    ``(variables, output, aux)``: one entry per Variable, ``None`` where
    tracing found it unchanged; the output with graph nodes replaced by their
    arrays; and an ``_Aux`` that tells the caller which is which.
    """

    def __init__(
        self,
        lifted: Lifted,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        statics: tuple[Any, ...],
        mesh: Any,
    ):
        self.lifted, self.treedef, self.statics, self.mesh = lifted, treedef, statics, mesh
        self.node_pos = tuple(i for i, leaf in enumerate(leaves) if is_graph_leaf(leaf))
        self.dyn_pos = tuple(i for i, leaf in enumerate(leaves) if not is_graph_leaf(leaf))
        self.split = GraphSplit(tuple(leaves[i] for i in self.node_pos))
        self.leaf_paths = _leaf_paths(lifted, args, kwargs, statics)
        donated = _donated_leaves(lifted, args, kwargs, statics)
        var_specs, dyn_specs = self._resolve_in_specs(args, leaves)

        var_donated = [donated[self.node_pos[path[0]]] for path in self.split.paths]
        self.var_groups = _partition(range(len(var_specs)), var_donated)
        self.dyn_groups = _partition(self.dyn_pos, [donated[i] for i in self.dyn_pos])
        self.donated = bool(self.var_groups[1] or self.dyn_groups[1])
        in_specs = (
            tuple(var_specs[i] for i in self.var_groups[0]),
            tuple(dyn_specs[i] for i in self.dyn_groups[0]),
            tuple(var_specs[i] for i in self.var_groups[1]),
            tuple(dyn_specs[i] for i in self.dyn_groups[1]),
        )
        self.in_specs = in_specs
        donate_argnums = (2, 3) if self.donated else ()
        staged_key = (self.split.key, treedef, statics, in_specs, donate_argnums, mesh)
        staged = lifted._staged.get(staged_key)
        if staged is None:
            spec = StageSpec(
                in_specs=in_specs,
                out_specs=(var_specs, self._resolve_out_specs(leaves), None),
                mesh=mesh,
                donate_argnums=donate_argnums,
                options=lifted.options,
            )
            staged = lifted.backend.stage(self._pure_function(), spec)
            lifted._staged[staged_key] = staged
        self.staged = staged
        self._index_map = self.split.index_map()
        self._place_variables(var_specs)

    # -- per call ---------------------------------------------------------------------
    def inputs(self, leaves: list[Any]) -> tuple[tuple[Any, ...], ...]:
        """The staged function's four arguments, gathered from the caller's objects."""
        values = self.split.gather()
        if not self.donated:
            return values, tuple(leaves[i] for i in self.dyn_pos), (), ()
        return (
            tuple(values[i] for i in self.var_groups[0]),
            tuple(leaves[i] for i in self.dyn_groups[0]),
            tuple(values[i] for i in self.var_groups[1]),
            tuple(leaves[i] for i in self.dyn_groups[1]),
        )

    def run(self, staged: Any, inputs: tuple[tuple[Any, ...], ...]) -> Any:
        """Call ``staged``, write updated Variables back, rebuild graph nodes in the output.

        Arrays already placed with another sharding than the plan's (JAX refuses
        those) are moved to the plan's sharding and the call is made again.
        """
        try:
            outputs = staged(*inputs)
        except ValueError:
            moved = self._reshard(inputs)
            if moved is None:
                raise
            outputs = staged(*moved)
        var_out, user_out, aux = outputs
        self.split.scatter(aux.info.changed, var_out)
        if not aux.info.out_graphdefs:
            return user_out
        return _decode_outputs(user_out, aux.info, self._index_map)

    def _place_variables(self, shardings: tuple[Sharding | None, ...]) -> None:
        """Move Variables whose arrays are not where the plan puts them (once, not per call).

        Under an outer trace (jax.jit, make_jaxpr) the moved values are tracers,
        which must never be written into the caller's objects: then nothing moves.
        """
        values = self.split.gather()
        placed = _onto(values, shardings)
        if placed is None or any(isinstance(v, jax.core.Tracer) for v in placed):
            return
        self.split.scatter(range(len(placed)), placed)

    def _reshard(self, inputs: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...] | None:
        """``inputs`` with each array put on its planned sharding; None if all already were."""
        placed = [_onto(group, specs) for group, specs in zip(inputs, self.in_specs, strict=True)]
        if all(p is None for p in placed):
            return None
        return tuple(
            group if p is None else tuple(p) for group, p in zip(inputs, placed, strict=True)
        )

    def abstract_index_map(self) -> graphlib.IndexMap:
        """Like the caller's index map, but over abstract copies of the nodes (for eval_shape)."""
        nodes = self.split.rebuild([_abstract(v) for v in self.split.gather()])
        ref_index = graphlib.RefMap()
        nnx.graph.flatten(nodes, ref_index=ref_index)
        return graphlib.IndexMap({index: node for node, index in ref_index.items()})

    # -- tracing ----------------------------------------------------------------------
    def _pure_function(self) -> Callable[..., Any]:
        lifted, split, treedef, statics = self.lifted, self.split, self.treedef, self.statics
        node_pos = self.node_pos
        var_order = self.var_groups[0] + self.var_groups[1]
        dyn_order = self.dyn_groups[0] + self.dyn_groups[1]
        donated_vars = frozenset(self.var_groups[1])
        n_leaves = len(node_pos) + len(dyn_order)
        names = [self.leaf_paths[i] for i in node_pos]

        def pure(kept_vars, kept_dyn, donated_var_values, donated_dyn):
            var_values: list[Any] = [None] * len(var_order)
            for i, value in zip(var_order, (*kept_vars, *donated_var_values), strict=True):
                var_values[i] = value
            nodes = split.rebuild(var_values)
            leaves: list[Any] = [None] * n_leaves
            for i, node in zip(node_pos, nodes, strict=True):
                leaves[i] = node
            for i, value in zip(dyn_order, (*kept_dyn, *donated_dyn), strict=True):
                leaves[i] = value
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            out = lifted.fun(*_insert_statics(args, statics), **kwargs, **_named_statics(statics))

            ref_index = graphlib.RefMap()
            graphdef, new_values = nnx.graph.flatten(nodes, ref_index=ref_index, with_paths=False)
            if fingerprint(graphdef) != split.key:
                raise StructureChangedError(
                    f"{lifted.__name__} changed the structure of its arguments: "
                    f"{split.describe_change(split.rebuild(var_values), nodes, names)}. meshlift writes "
                    f"back array values only; make structural changes (new attributes, replaced "
                    f"submodules, static fields) outside the lifted function."
                )
            changed = tuple(
                i
                for i, (new, old) in enumerate(zip(new_values, var_values, strict=True))
                if new is not old or i in donated_vars
            )
            kept = frozenset(changed)
            var_out = tuple(v if i in kept else None for i, v in enumerate(new_values))
            user_out, info = _encode_outputs(out, ref_index, changed)
            return var_out, user_out, _Aux(info)

        pure.__name__ = getattr(lifted.fun, "__name__", "lifted")
        pure.__qualname__ = getattr(lifted.fun, "__qualname__", pure.__name__)
        return pure

    # -- plan resolution ----------------------------------------------------------------
    def _resolve_in_specs(
        self, args: tuple[Any, ...], leaves: list[Any]
    ) -> tuple[tuple[Sharding | None, ...], dict[int, Sharding | None]]:
        """One sharding per Variable (split order) and per other leaf (by leaf position)."""
        positional = _positional_prefix(self.lifted, args)
        in_name = self.lifted.in_name
        prefix = _broadcast_prefix(positional, args, in_name, "arguments")
        prefix += [None] * (len(leaves) - len(prefix))  # kwargs take no specs, as in jax.jit
        var_index = {id(v): i for i, v in enumerate(self.split.variables)}
        var_specs: list[Sharding | None] = [None] * len(var_index)
        origin: dict[int, tuple[str, Any]] = {}
        for pos in self.node_pos:
            for path, variable in variable_paths(leaves[pos]):
                full = ".".join(
                    filter(None, (self.leaf_paths[pos], format_path(path) if path else ""))
                )
                spec = prefix[pos]
                if isinstance(spec, StateSharding):
                    spec = spec.spec_for(path, variable)
                i = var_index[id(variable)]
                if i not in origin:
                    origin[i] = (full, spec)
                    var_specs[i] = to_sharding(spec, self.mesh, full, variable, in_name)
                elif origin[i][1] != spec:
                    raise PlanError(
                        f"the shared Variable at `{origin[i][0]}` and `{full}` (shape "
                        f"{value_shape(variable)}) is given two specs, {origin[i][1]} and {spec}, on "
                        f"mesh {_mesh_shape(self.mesh)}; give both paths the same spec"
                    )
        dyn_specs = {}
        for pos in self.dyn_pos:
            spec = prefix[pos]
            if isinstance(spec, StateSharding):
                spec = spec.spec_for(tuple(self.leaf_paths[pos].split(".")), leaves[pos])
            path = self.leaf_paths[pos]
            dyn_specs[pos] = to_sharding(spec, self.mesh, path, leaves[pos], in_name)
        return tuple(var_specs), dyn_specs

    def _resolve_out_specs(self, leaves: list[Any]) -> Any:
        """The output's shardings; a plan for output modules is resolved on an abstract trace."""
        out_specs = self.lifted.out_specs
        if not any(isinstance(s, StateSharding | Mapping) for s in _spec_leaves(out_specs)):
            return jax.tree.map(
                lambda s: to_sharding(s, self.mesh, "output", None, self.lifted.out_name),
                out_specs,
                is_leaf=is_spec,
            )
        abstract_inputs = jax.tree.map(_abstract, self.inputs(leaves))
        try:
            _, user_out, aux = jax.eval_shape(self._pure_function(), *abstract_inputs)
        except NameError as e:  # a collective over a mesh axis, outside the backend's map
            raise PlanError(
                f"{self.lifted.out_name} holds a StateSharding, which meshlift resolves by tracing "
                f"{self.lifted.__name__} outside the {self.lifted.backend.name} backend, where its "
                f"collectives cannot run ({e}). Give {self.lifted.out_name} as PartitionSpecs "
                f"for this backend."
            ) from None
        abstract_out = _decode_outputs(user_out, aux.info, self.abstract_index_map())
        return _output_leaf_specs(
            out_specs, abstract_out, aux.info, self.mesh, self.lifted.out_name
        )


class Traced:
    """JAX's ``Traced`` for a lifted function; ``.lower()`` continues to a ``Lowered``."""

    def __init__(self, traced: Any, binding: _Binding):
        self.jax_traced, self._binding = traced, binding

    def lower(self, **kwargs: Any) -> Lowered:
        return Lowered(self.jax_traced.lower(**kwargs), self._binding)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jax_traced, name)


class Lowered:
    """JAX's ``Lowered`` for a lifted function (``as_text``, ``cost_analysis``...)."""

    def __init__(self, lowered: Any, binding: _Binding):
        self.jax_lowered, self._binding = lowered, binding

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        return Compiled(self.jax_lowered.compile(compiler_options), self._binding)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jax_lowered, name)


class Compiled:
    """JAX's ``Compiled``, called with the same kind of arguments as the lifted function.

    ``as_text``, ``cost_analysis``, ``memory_analysis``, ``input_shardings`` and
    ``output_shardings`` are JAX's, in terms of the staged function's flat inputs.
    """

    def __init__(self, compiled: Any, binding: _Binding):
        self.jax_compiled, self._binding = compiled, binding

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding, leaves = self._binding.lifted._bind(args, kwargs, self._binding.mesh)
        if binding.staged is not self._binding.staged:
            raise TypeError(
                "these arguments differ in structure, shardings or static values from the ones "
                "this function was compiled for; call .lower(...).compile() again for them"
            )
        return binding.run(self.jax_compiled, binding.inputs(leaves))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jax_compiled, name)


def transform(
    backend: str | Backend,
    fun: Callable[..., Any] | None = None,
    /,
    *,
    mesh: Any = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Iterable[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    **options: Any,
) -> Any:
    """Lift ``fun`` with any backend, by name or object, using the unified argument names.

    ``in_specs``/``out_specs`` are pytree prefixes of the positional arguments
    and the output, with ``PartitionSpec``, ``NamedSharding``, ``None`` or
    ``StateSharding`` leaves. Other keyword options go to the backend.

    Example::

        step = ml.transform("jit", train_step, mesh=mesh, in_specs=(plan, P("data")),
                            out_specs=P())
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
    if fun is None:
        return lambda f: Lifted(f, backend, **kwargs)
    return Lifted(fun, backend, **kwargs)


# -- helpers -----------------------------------------------------------------------------


def _parameter_names(fun: Callable[..., Any]) -> list[str]:
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def _infer_argnums_and_argnames(
    names: list[str], argnums: int | Iterable[int] | None, argnames: str | Iterable[str] | None
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """jax.jit's rule: given only numbers, infer the names from the signature, and back."""
    nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
    strs = () if argnames is None else (argnames,) if isinstance(argnames, str) else tuple(argnames)
    if argnums is not None and argnames is None:
        strs = tuple(names[i] for i in nums if -len(names) <= i < len(names))
    elif argnames is not None and argnums is None:
        nums = tuple(names.index(n) for n in strs if n in names)
    return nums, strs


def _insert_statics(args: tuple[Any, ...], statics: tuple[Any, ...]) -> list[Any]:
    out = list(args)
    for where, value in statics:
        if isinstance(where, int):
            out.insert(where, value)
    return out


def _named_statics(statics: tuple[Any, ...]) -> dict[str, Any]:
    return {where: value for where, value in statics if isinstance(where, str)}


def _original_index(j: int, statics: tuple[Any, ...]) -> int:
    """The caller's position of the j-th non-static positional argument."""
    static_nums = sorted(where for where, _ in statics if isinstance(where, int))
    i = j
    for s in static_nums:
        if s <= i:
            i += 1
    return i


def _leaf_paths(
    lifted: Lifted, args: tuple[Any, ...], kwargs: dict[str, Any], statics: tuple[Any, ...]
) -> list[str]:
    """A readable path per leaf: ``model`` for a module argument, ``batch.x`` inside a dict."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_graph_leaf)
    out = []
    for keypath, _ in with_paths:
        which, first, *rest = keypath
        if key_name(which) == "0":
            head = lifted._arg_name(_original_index(int(key_name(first)), statics))
        else:
            head = key_name(first)
        out.append(".".join([head, *map(key_name, rest)]))
    return out


def _donated_leaves(
    lifted: Lifted, args: tuple[Any, ...], kwargs: dict[str, Any], statics: tuple[Any, ...]
) -> list[bool]:
    flags: list[bool] = []
    for j, arg in enumerate(args):
        donate = _original_index(j, statics) in lifted.donate_argnums
        flags += [donate] * len(jax.tree.leaves(arg, is_leaf=is_graph_leaf))
    for name, value in kwargs.items():
        donate = name in lifted.donate_argnames
        flags += [donate] * len(jax.tree.leaves(value, is_leaf=is_graph_leaf))
    return flags


def _partition(items: Iterable[int], flags: list[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    items = list(items)
    return (
        tuple(i for i, f in zip(items, flags, strict=True) if not f),
        tuple(i for i, f in zip(items, flags, strict=True) if f),
    )


def _spec_leaves(specs: Any) -> list[Any]:
    return jax.tree.leaves(specs, is_leaf=lambda x: is_spec(x) or isinstance(x, Mapping))


def _positional_prefix(lifted: Lifted, args: tuple[Any, ...]) -> Any:
    """``in_specs`` as a prefix of the non-static positional arguments."""
    specs = lifted.in_specs
    if not isinstance(specs, tuple | list):
        return specs
    specs = tuple(specs)
    if len(specs) == len(args):
        return specs
    n_static = len([n for n in lifted.static_argnums if n >= 0])
    if n_static and len(specs) == len(args) + n_static:
        return tuple(s for i, s in enumerate(specs) if i not in lifted.static_argnums)
    raise PlanError(
        f"in_specs has {len(specs)} entries but {lifted.__name__} was called with {len(args)} "
        f"positional arguments (not counting static ones); give one spec per argument, or a "
        f"single spec for all"
    )


def _broadcast_prefix(prefix: Any, tree: Any, what: str, noun: str, path: str = "") -> list[Any]:
    """One spec per leaf of ``tree`` (graph nodes are leaves) from a prefix of it."""
    if is_graph_leaf(tree) and isinstance(prefix, Mapping):
        prefix = StateSharding.from_state(prefix)
    if is_spec(prefix) or is_graph_leaf(tree):
        if not is_spec(prefix):
            raise PlanError(
                f"{what} at `{path or '<root>'}` is a {type(prefix).__name__} but the value "
                f"there is a {type(tree).__name__}; use a PartitionSpec or a StateSharding"
            )
        return [prefix] * len(jax.tree.leaves(tree, is_leaf=is_graph_leaf))
    if isinstance(prefix, tuple | list) and isinstance(tree, tuple | list):
        if len(prefix) == len(tree):
            return [
                spec
                for i, (p, t) in enumerate(zip(prefix, tree, strict=True))
                for spec in _broadcast_prefix(p, t, what, noun, f"{path}[{i}]")
            ]
    elif isinstance(prefix, Mapping) and isinstance(tree, Mapping) and set(prefix) == set(tree):
        return [
            spec
            for k in sorted(tree)
            for spec in _broadcast_prefix(prefix[k], tree[k], what, noun, f"{path}.{k}".lstrip("."))
        ]
    else:  # any other pytree node (a flax struct such as TrainState): match it one level down
        prefix_children, prefix_def = _one_level(prefix)
        tree_children, tree_def = _one_level(tree)
        is_node = not (len(prefix_children) == 1 and prefix_children[0][1] is prefix)
        if is_node and prefix_def == tree_def:
            return [
                spec
                for (key, p), (_, t) in zip(prefix_children, tree_children, strict=True)
                for spec in _broadcast_prefix(p, t, what, noun, f"{path}.{key}".lstrip("."))
            ]
    raise PlanError(
        f"{what} does not match the {noun} at "
        f"`{path or '<root>'}`: the spec is {prefix!r} but the value is a "
        f"{type(tree).__name__}; a spec tree must be a prefix of it (one entry per tuple "
        f"element or dict key)"
    )


def _one_level(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The (key, child) pairs of a pytree node, and its one-level treedef."""
    children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    return [(".".join(key_name(k) for k in keys), child) for keys, child in children], treedef


def _onto(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any] | None:
    """``values`` with each array not on its sharding moved there; None if none had to move."""
    misplaced = [
        i
        for i, (value, sharding) in enumerate(zip(values, shardings, strict=True))
        if sharding is not None and getattr(value, "sharding", sharding) != sharding
    ]
    if not misplaced:
        return None
    moved = jax.device_put([values[i] for i in misplaced], [shardings[i] for i in misplaced])
    placed = list(values)
    for i, value in zip(misplaced, moved, strict=True):
        placed[i] = value
    return placed


def _mesh_shape(mesh: Any) -> Any:
    return dict(mesh.shape) if mesh is not None else None


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x


def _encode_outputs(
    out: Any, ref_index: graphlib.RefMap, changed: tuple[int, ...]
) -> tuple[Any, _TraceInfo]:
    """Replace graph nodes in the output by the tuple of their new arrays."""
    leaves, treedef = jax.tree.flatten(out, is_leaf=is_graph_leaf)
    graphdefs, paths = {}, {}
    for i, leaf in enumerate(leaves):
        if is_graph_leaf(leaf):
            graphdefs[i], flat = nnx.graph.flatten(leaf, ref_index=ref_index)
            paths[i] = tuple(flat.paths)
            leaves[i] = tuple(
                v.get_raw_value() if isinstance(v, nnx.Variable) else v for v in flat.leaves
            )
    info = _TraceInfo(changed, treedef, graphdefs, paths)
    return (jax.tree.unflatten(treedef, leaves) if graphdefs else out), info


def _decode_outputs(user_out: Any, info: _TraceInfo, index_map: graphlib.IndexMap) -> Any:
    """Rebuild graph nodes in the output; references to inputs resolve through ``index_map``."""
    if not info.out_graphdefs:
        return user_out
    items = info.out_treedef.flatten_up_to(user_out)
    index_map = graphlib.IndexMap(index_map)
    for i, graphdef in info.out_graphdefs.items():
        items[i] = nnx.graph.unflatten(graphdef, list(items[i]), index_ref=index_map)
    return info.out_treedef.unflatten(items)


def _output_leaf_specs(
    out_specs: Any, abstract_out: Any, info: _TraceInfo, mesh: Any, what: str
) -> Any:
    """Shardings for the encoded output, with a plan resolved per Variable of output modules."""
    prefix = _broadcast_prefix(out_specs, abstract_out, what, "output")
    leaves = info.out_treedef.flatten_up_to(abstract_out)
    keypaths = [
        k for k, _ in jax.tree_util.tree_flatten_with_path(abstract_out, is_leaf=is_graph_leaf)[0]
    ]
    result = []
    for i, (spec, leaf) in enumerate(zip(prefix, leaves, strict=True)):
        if i not in info.out_graphdefs:
            path = tuple(map(key_name, keypaths[i]))
            if isinstance(spec, StateSharding):
                spec = spec.spec_for(path, leaf)
            result.append(to_sharding(spec, mesh, format_path(("output", *path)), leaf, what))
            continue
        variables = dict(variable_paths(leaf))
        shardings = []
        for path in info.out_paths[i]:
            leaf_spec = (
                spec.spec_for(path, variables[path]) if isinstance(spec, StateSharding) else spec
            )
            shardings.append(
                to_sharding(leaf_spec, mesh, f"output.{format_path(path)}", variables[path], what)
            )
        result.append(tuple(shardings))
    return info.out_treedef.unflatten(result)
