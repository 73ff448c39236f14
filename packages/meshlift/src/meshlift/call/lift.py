"""`Lifted` and `transform`: a function lifted over stateful arguments, staged by a backend.

A call finds its entry (`meshlift.call.caches`): the arguments' layout
(`meshlift.call.layout`) and the staged pure function (`meshlift.call.pure`), made
on a miss; then runs it, all or nothing (`meshlift.call.calls`). A call like
the last one runs on the `CallPlan` that call left (`meshlift.call.call_plans`).
Staged functions are keyed by structure only, never an identity, and
shared by every wrapper of one function and options, as `jax.jit` shares
its cache. `transform` below shows a train step.

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

import copy
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Generic, ParamSpec, TypeAlias, TypeVar, overload

from jax.sharding import AbstractMesh, Mesh

from meshlift import compat, modes, speedups
from meshlift.backend import Backend, Specs, StageSpec
from meshlift.call import call_plans, calls, methods, static_changes
from meshlift.call.arguments import Signature, static_key
from meshlift.call.caches import LayoutCache, options_key, shared_stages
from meshlift.call.calls import Entry
from meshlift.call.layout import (
    Call,
    Layout,
    Names,
    flat_treedef,
    flatten_arguments,
    node_positions,
    pass_key,
)
from meshlift.call.options import LiftOptions
from meshlift.call.pure import StaleLayout
from meshlift.call.staged_errors import named_errors
from meshlift.call.stages import Lowered, Traced
from meshlift.errors import RetraceWarning
from meshlift.paths import listing, user_stacklevel
from meshlift.plans import resolve
from meshlift.plans.mesh import InMesh, current_mesh
from meshlift.plugins import get_backend

Params = ParamSpec("Params")  # the lifted function's parameters
Result = TypeVar("Result")  # and what it returns
# What `mesh=` takes: a mesh, a function giving one at each call, or None (the call site's).
MeshLike: TypeAlias = Mesh | AbstractMesh | Callable[[], Mesh | AbstractMesh | None] | None
# Calls in a row that re-trace because their trace changed a static value, before a warning.
_RETRACES_BEFORE_WARNING = 3


class Lifted(Generic[Params, Result]):
    """A function lifted over stateful arguments, staged by one backend.

    Made by `ml.transform` (the front ends `ml.jit`, `ml.shard_map` and
    `ml.pjit` go through it). Calling it runs the staged function and writes
    updated Variables back; `trace`, `lower` and `eval_shape` give JAX's
    stages, wrapped so that compiled objects are called with modules too.

    `mesh` is a mesh, a function returning one at each call, or None for
    the mesh of `ml.use_mesh`. The backend's readers (`Backend.read_specs`,
    `read_mesh`, `read_options`) say what the specs, the mesh and the
    options mean for it.

    Args:
        fun: The function to lift; a bound method of a module lifts the module too.
        backend: A backend name (`"jit"`) or a `Backend` object.
        in_specs: Specs of the positional arguments (a pytree prefix); None: unspecified.
        out_specs: Specs of the output (a pytree prefix); None: unspecified.
        mesh: A mesh, a function returning one at each call, or None for the call site's.
        lift: The lift options: static and donated arguments (`ml.LiftOptions`); None:
            none.
        options: Backend options, read by `Backend.read_options`.

    Raises:
        TypeError: If `fun` is not callable, `mesh` is not a mesh, a function or None,
            or the backend's `read_specs` returns no `Specs`.
        ValueError: If the static or donated arguments do not fit `fun`'s signature,
            as `jax.jit` checks them.
        meshlift.BackendNotFoundError: If no installed backend has the name `backend`.
        meshlift.errors.PluginError: If two plugins register the name `backend`.
        meshlift.PlanError: If a module stands where specs go; at a call, if a spec
            does not fit its argument.
        meshlift.StructureChangedError: At a call under `nnx.cached_partial`, if `fun`
            changed its arguments' structure.
        meshlift.TraceLeakError: At a call inside an outer JAX transform, if writing
            back would leak its tracers into the caller's objects.
    """

    def __init__(
        self,
        fun: Callable[Params, Result],
        backend: str | Backend,
        *,
        in_specs: Any = None,
        out_specs: Any = None,
        mesh: MeshLike = None,
        lift: LiftOptions | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if not callable(fun):
            raise TypeError(f"expected a function to lift, got {type(fun).__name__}: {fun!r}")
        if not (mesh is None or callable(mesh) or isinstance(mesh, Mesh | AbstractMesh)):
            shape = dict(mesh) if isinstance(mesh, Mapping) else {"data": 2, "model": 4}
            raise TypeError(
                f"mesh= takes a jax.sharding.Mesh (or AbstractMesh), got "
                f"{type(mesh).__name__}: {mesh!r}; make one with `ml.make_mesh({shape})`"
            )
        functools.update_wrapper(self, fun)
        self._made_with = (fun, backend, in_specs, out_specs, mesh, lift, options)
        self.backend = get_backend(backend)
        options = dict(options or {})
        self.specs = _checked_specs(self.backend, in_specs, out_specs, options)
        self.mesh = self.backend.read_mesh(mesh)
        self.options = self.backend.read_options(options)
        traits = self.backend.capabilities
        per_shard = "manual-collectives" in traits  # in its own mesh
        self._passes_through_none = "passes-through-none" in traits
        self._sets_mesh = self.mesh is not None and not per_shard  # mesh= is a mesh context
        argnums = (lift or LiftOptions()).argnums
        self._receiver = methods.graph_receiver(fun)
        if self._receiver is not None:  # `m.method`: m becomes the first argument of each call
            Signature(fun, *argnums)  # jax.jit's checks, against the signature the caller sees
            fun, argnums = fun.__func__, methods.after_receiver(*argnums)  # type: ignore[attr-defined]
            self.specs = methods.with_receiver_spec(self.specs)
        self.fun = fun
        self.names = Names(
            getattr(fun, "__name__", "the lifted function"),
            *self.specs.names,
            self.backend.name,
            self.backend.origin,
        )
        self.signature = Signature(fun, *argnums)
        self._graph_context = compat.graph_context()
        self._entries = LayoutCache()
        self._plan: speedups.CallPlan | None = None  # the last call's, if the next may repeat it
        self._retraces = 0  # calls in a row whose trace changed a static value in place
        sig, specs = self.signature, self.specs
        self._staged = shared_stages(
            fun,
            options_key(
                (specs.in_specs, specs.out_specs, specs.meshless),
                self.backend,
                self.names,
                sig.static_argnums,
                sig.static_argnames,
                sig.donate_argnums,
                sig.donate_argnames,
                tuple(sorted(self.options.items())),
            ),
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as the arguments it was made with (a copy traces anew), as `jax.jit`'s
        functions are; pickle a lambda or a closure with cloudpickle."""
        return _remade, self._made_with

    def __deepcopy__(self, memo: dict[int, Any]) -> Lifted[Params, Result]:
        """A new lifted function of a deep copy of `fun` (a bound method: of a copy of its
        object) with the same options, as `copy.deepcopy(jax.jit(f))` gives."""
        fun, *rest = self._made_with
        return _remade(copy.deepcopy(fun, memo), *rest)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__qualname__", None) or f"a {type(self.fun).__name__}"
        return f"<meshlift.{self.backend.name} of {name}>"

    def _cache_size(self) -> int:
        """How many programs this function has compiled (`jax.jit(f)._cache_size()`)."""
        return sum(_programs(staged) for staged in self._staged.values())

    def clear_cache(self) -> None:
        """Forget every staged and compiled program and argument layout (`jax.jit`'s).

        The next call traces and compiles again.
        """
        for staged in self._staged.values():
            getattr(staged, "clear_cache", lambda: None)()
        self._staged.clear()
        self._entries = LayoutCache()
        self._plan = None

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Lifted[Params, Result]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Result]: ...

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else methods.BoundLifted(self, obj)

    def __call__(self, *args: Params.args, **kwargs: Params.kwargs) -> Result:
        if self._receiver is not None:
            args = (self._receiver, *args)  # type: ignore[assignment]
        cached = self._graph_context.tmp_static_cache is not None
        if cached:  # called by nnx.cached_partial: take its cache, as flax's transforms do
            self._graph_context.tmp_static_cache = None
        plan = self._plan
        if plan is not None and not kwargs and not static_changes.collecting():
            inputs = speedups.plan_inputs(plan, args)
            if inputs is not None:  # a call like the last: its program, on the plan
                recorded = static_changes.recorded()
                try:
                    outputs = plan.staged(*inputs)
                except BaseException as error:
                    adopted = static_changes.adopt(recorded)
                    return self._keeping(adopted, self._planned_error, plan, args, error, cached)
                if static_changes.recorded() == recorded and speedups.plan_write(plan, outputs):
                    return outputs[2]
                adopted = static_changes.adopt(recorded)  # its trace changed a static value
                return self._keeping(adopted, self._planned_rest, plan, args, outputs, cached)
        return self._keeping(static_changes.begin(), self._call, args, kwargs, cached)

    def _keeping(self, traced: Any, run: Callable[..., Any], *args: Any) -> Any:
        """`run(*args)`, keeping what its traces changed in place (collected since `traced`)
        if it succeeds, else undoing it."""
        try:
            result = run(*args)
        except BaseException as error:
            if stuck := static_changes.end(traced, keep=False):
                error.add_note(f"meshlift could not undo the change in place of {listing(stuck)}")
            raise
        static_changes.end(traced, keep=True)
        return result

    def _call(self, args: tuple, kwargs: dict, cached: bool) -> Any:
        """A call the last one's plan does not fit: its entry found (or made), then run."""
        try:
            return self._run(*self._entry(args, kwargs), cached)
        except StaleLayout:
            return self._run_fresh(args, kwargs, cached)

    def _run_fresh(self, args: tuple, kwargs: dict, cached: bool) -> Any:
        """A call on a new layout: a Variable holds another kind of value than its entry's
        layout was made for (`StaleLayout`)."""
        return self._run(*self._entry(args, kwargs, fresh=True), cached)

    def _run(self, entry: Entry, call: Call, cached: bool) -> Any:
        """Run `entry` for `call`, and keep the plan for calls like it."""
        call.fixed_structure = cached
        result = calls.run(entry, entry.staged, call)
        self._plan = self._plan_after(entry, call)
        return result

    def _planned_error(
        self, plan: speedups.CallPlan, args: tuple, error: BaseException, cached: bool
    ) -> Any:
        """The program of a call that `plan` matched raised `error`: the call made again
        where JAX refused an array's sharding, else `error` in the caller's names."""
        if isinstance(error, StaleLayout):
            return self._run_fresh(args, {}, cached)
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit
            raise error
        call = Call.of_arguments(args, plan.node_positions, cached)
        values = plan.entry.layout.split.gather()
        try:
            return calls.recover(plan.entry, error, plan.staged, values, None, call)
        except StaleLayout:
            return self._run_fresh(args, {}, cached)

    def _planned_rest(
        self, plan: speedups.CallPlan, args: tuple, outputs: Any, cached: bool
    ) -> Any:
        """The outputs of a call that `plan` matched, which its C step did not write back
        (its trace changed a static value; a value that is no array): written back the
        general way."""
        entry = plan.entry
        call = Call.of_arguments(args, plan.node_positions, cached)
        try:
            result = calls.finish(entry, outputs, entry.layout.split.gather(), None, call)
        except StaleLayout:
            return self._run_fresh(args, {}, cached)
        self._plan = self._plan_after(entry, call)
        return result

    def _plan_after(self, entry: Entry, call: Call) -> speedups.CallPlan | None:
        """The plan for calls like `call`, which ran `entry` and succeeded; none if its trace
        changed a static value in place, or stored a mutable static object it made (a new
        list): then the next call traces again, as eager execution runs the Python again
        (and makes the object anew, where the program would hand the caller the one it
        made then, changed in place since maybe). A warning once this keeps happening."""
        changed = static_changes.pending()
        update = entry.info.update if entry.info is not None else None
        if not changed and (update is None or not update.made):
            self._retraces = 0
            return call_plans.plan_after(entry, call, self.mesh) if modes.fast_paths else None
        self._forget(entry)
        self._retraces += 1
        if self._retraces == _RETRACES_BEFORE_WARNING:
            what = f"changes {listing(changed)} in place" if changed else "stores a new object"
            warnings.warn(
                f"{self.names.function} has re-traced on each of its last {self._retraces} "
                f"calls because it {what}: a static value is compiled into the program, "
                f"so each change is a new program. If the value is data, keep it in an "
                f"nnx.Variable (or pass it as an array); if it is a setting, change it "
                f"outside the lifted function",
                RetraceWarning,
                stacklevel=user_stacklevel(),
            )
        return None

    def _forget(self, entry: Entry) -> None:
        """Forget `entry` and its staged function (its trace changed a static value in
        place), so that the next call makes a new layout and traces again."""
        self._entries.discard(entry)
        for key in [key for key, staged in self._staged.items() if staged is entry.staged]:
            del self._staged[key]

    def trace(self, *args: Params.args, **kwargs: Params.kwargs) -> Traced:
        """Trace for these arguments; `.lower()` continues. Nothing is written back.

        Args:
            *args: The positional arguments, as for a call.
            **kwargs: The keyword arguments, as for a call.

        Returns:
            A `Traced` wrapping JAX's, with inputs and outputs in the caller's terms.

        Raises:
            AttributeError: If the backend's staged function has no `trace` (no `stages`
                capability).
            meshlift.PlanError: If a spec does not fit its argument.
        """

        def trace(entry: Entry, call: Call) -> Traced:
            staged = self._stage_method(entry, "trace")
            return Traced(staged(*calls.placed_inputs(entry.layout, call)), entry, self)

        return self._staging(self._bound(args), kwargs, trace)

    def lower(self, *args: Params.args, **kwargs: Params.kwargs) -> Lowered:
        """Lower for these arguments; `.compile()` continues.

        The `Compiled` is called like this function without the static arguments
        (they are part of the program).

        Args:
            *args: The positional arguments, as for a call.
            **kwargs: The keyword arguments, as for a call.

        Returns:
            A `Lowered` wrapping JAX's.

        Raises:
            AttributeError: If the backend's staged function has no `lower` (no `stages`
                capability).
            meshlift.PlanError: If a spec does not fit its argument.
        """

        def lower(entry: Entry, call: Call) -> Lowered:
            staged = self._stage_method(entry, "lower")
            return Lowered(staged(*calls.placed_inputs(entry.layout, call)), entry, self)

        return self._staging(self._bound(args), kwargs, lower)

    def eval_shape(self, *args: Params.args, **kwargs: Params.kwargs) -> Any:
        """Output shapes and dtypes, graph outputs as abstract modules; nothing is written back.

        Args:
            *args: The positional arguments, as for a call.
            **kwargs: The keyword arguments, as for a call.

        Returns:
            The output with `jax.ShapeDtypeStruct` leaves, modules abstract.

        Raises:
            meshlift.PlanError: If a spec does not fit its argument.
        """
        return self._staging(self._bound(args), kwargs, calls.eval_shape)

    def _staging(self, args: tuple, kwargs: dict, step: Callable[[Entry, Call], Any]) -> Any:
        """`step(entry, call)` for these arguments' entry, errors in the caller's names;
        again on a new layout where a Variable holds another kind of value than before.
        A stage writes nothing back: what its trace changed in place is undone, and the
        program it traced forgotten, so that a call runs the Python again."""
        traced = static_changes.begin()
        entry = None
        try:
            try:
                entry, call = self._entry(args, kwargs)
                with named_errors(entry.layout, call):
                    return step(entry, call)
            except StaleLayout:
                entry, call = self._entry(args, kwargs, fresh=True)
                with named_errors(entry.layout, call):
                    return step(entry, call)
        finally:
            if static_changes.pending() and entry is not None:
                self._forget(entry)
            static_changes.end(traced, keep=False)

    def _stage_method(self, entry: Entry, method: str) -> Any:
        """`entry.staged.<method>` (`trace`, `lower`); its absence names the backend."""
        found = getattr(entry.staged, method, None)
        if found is None:
            names = self.names
            raise AttributeError(
                f"backend {names.backend!r} ({names.origin}) staged {names.function} as "
                f"{type(entry.staged).__name__}, which has no .{method}(): its stage() must "
                f"return what jax.jit returns for {names.function}.{method}() to work (the "
                f"'stages' capability)"
            )
        return found

    def _bound(self, args: tuple) -> tuple:
        """The arguments with the receiver of a lifted bound method first."""
        return args if self._receiver is None else (self._receiver, *args)

    def _entry(
        self, args: tuple, kwargs: dict, mesh: Any = None, fresh: bool = False
    ) -> tuple[Entry, Call]:
        """The entry for these arguments' layout (made if new or stale), and this call's leaves.

        `mesh` overrides the call-site lookup (a compiled object keeps its mesh); `fresh`
        makes a new layout, replacing the cached one (its staged function met other values).
        """
        mesh = self._call_site_mesh() if mesh is None else mesh
        if fresh:
            self._plan = None  # its entry, too, was made for what the Variables held before
        plan = self._plan if modes.fast_paths else None
        if (
            plan is not None
            and not kwargs
            and plan.entry.layout.mesh is mesh
            and speedups.plan_matches(plan, args)
        ):
            return plan.entry, Call.of_arguments(args, plan.node_positions)
        args, kwargs, statics = self.signature.pop_statics(args, kwargs)
        if kwargs and self.specs.on(mesh)[0] is not None:
            self._refuse_keywords(kwargs)
        leaves, treedef = flatten_arguments(args, kwargs)
        leaf_types = tuple(map(type, leaves))
        positions = node_positions(leaf_types)
        nodes = tuple(map(leaves.__getitem__, positions))
        key: tuple[Any, ...] = (
            treedef,
            static_key(statics),
            leaf_types,
            tuple(map(id, nodes)),
            mesh,
        )
        if self._passes_through_none:  # a leaf that is no array may be compiled in
            key += tuple(pass_key(v) for i, v in enumerate(leaves) if i not in positions)
        call = Call(leaves, nodes)
        remember = modes.fast_paths
        try:
            entry = self._entries.get(key) if remember and not fresh else None
        except TypeError:  # an unhashable leaf: the Layout names it if it passes through
            entry, remember = None, False
        if entry is None or not entry.layout.split.unchanged():
            entry = self._new_entry(args, kwargs, call, treedef, statics, mesh)
            if remember:
                self._entries.put(key, entry, call.nodes)
        if not (kwargs or statics or entry.layout.passed) and treedef is flat_treedef(len(args)):
            call.flat_positions = positions  # a call like it may skip this lookup
        return entry, call

    def _new_entry(
        self,
        args: tuple,
        kwargs: dict,
        call: Call,
        treedef: Any,
        statics: tuple[Any, ...],
        mesh: Any,
    ) -> Entry:
        """The layout of these arguments, and its staged function (staged if new)."""
        layout = Layout(
            args,
            kwargs,
            call,
            treedef,
            statics,
            mesh,
            self.fun,
            signature=self.signature,
            names=self.names,
            specs=self.specs.on(mesh),
            passes_through_none=self._passes_through_none,
            reshards_arguments="reshards-arguments" in self.backend.capabilities,
        )
        staged = self._staged.get(layout.key)
        if staged is None:
            staged = self._stage(layout, call)
        return Entry(layout, staged)

    def _refuse_keywords(self, kwargs: dict) -> None:
        """Refuse dynamic keyword arguments next to specs, as `jax.jit` does."""
        raise ValueError(
            f"{self.names.function} was called with the keyword argument(s) "
            f"{', '.join(sorted(kwargs))} while {self.names.in_specs} is given: as jax.jit does not support kwargs when "
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

    def _stage(self, layout: Layout, call: Call) -> Any:
        """`layout`'s pure function staged by the backend, and kept for every wrapper."""
        spec = StageSpec(
            in_specs=layout.in_shardings,
            out_specs=(layout.var_shardings, None, layout.out_shardings(call), None),
            mesh=layout.mesh,
            donate_argnums=layout.donate_argnums,
            options=self.options,
        )
        names = self.names
        try:
            staged = self.backend.stage(layout.pure, spec)
        except Exception as error:
            error.add_note(
                f"raised while backend {names.backend!r} ({names.origin}) staged {names.function}"
            )
            raise
        if not callable(staged):
            raise TypeError(
                f"backend {names.backend!r} ({names.origin}) staged {names.function} as "
                f"{type(staged).__name__} {staged!r}: its stage(fn, spec) must return the staged "
                f"callable, such as jax.jit(fn, ...); did it forget to return it?"
            )
        if self._sets_mesh and isinstance(layout.mesh, Mesh):  # mesh= (or what it gave)
            staged = InMesh(staged, layout.mesh)
        self._staged[layout.key] = staged
        return staged


# -- helpers ---------------------------------------------------------------------------


def _remade(fun: Any, backend: Any, *made_with: Any) -> Any:
    """`Lifted` made again from what `__reduce__` gives."""
    in_specs, out_specs, mesh, lift, options = made_with
    return Lifted(
        fun, backend, in_specs=in_specs, out_specs=out_specs, mesh=mesh, lift=lift, options=options
    )


def _programs(staged: Any) -> int:
    """The programs a staged function has compiled: its `_cache_size()` (jax.jit's), else 1."""
    size = getattr(staged, "_cache_size", None)
    return size() if callable(size) else 1


def _checked_specs(backend: Backend, in_specs: Any, out_specs: Any, options: dict) -> Specs:
    """The specs as `backend` reads them; a graph node where specs go is refused."""
    specs = backend.read_specs(in_specs, out_specs, options)
    if not isinstance(specs, Specs):
        raise TypeError(
            f"backend {backend.name!r} read its specs as {type(specs).__name__}: {specs!r}; "
            f"Backend.read_specs must return a meshlift.Specs"
        )
    resolve.refuse_graph_nodes(zip(specs.names, (specs.in_specs, specs.out_specs), strict=True))
    return specs
