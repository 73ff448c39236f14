"""A lifted call: run the staged function, recover from what JAX refuses, write back.

All or nothing: every write is validated before the first is made, and a
call that raises leaves the caller's model as it was (a donated array that
a failed call consumed is named in the error). An `Entry` is one layout's
staged function and what its calls learned: whether the Variables were
placed onto the plan yet, and the last successful trace's `TraceInfo`.

Example:

```python
import jax.numpy as jnp
import meshlift as ml
from flax import nnx

class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.zeros(()))

def bump(counter, fail):
    counter.count[...] += 1
    if fail:
        raise ValueError("no")

counter, step = Counter(), ml.jit(bump, static_argnums=1)
step(counter, False)
try:
    step(counter, True)
except ValueError:
    pass
assert counter.count[...] == 1      # the failed call wrote nothing
```
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from meshlift import compat, speedups
from meshlift.call.layout import Call, Layout
from meshlift.call.pure import StaleLayout, TraceInfo, abstract_outputs, held_types
from meshlift.call.staged_errors import explain
from meshlift.errors import StructureChangedError, TraceLeakError
from meshlift.paths import Path, format_path, listing
from meshlift.plans import resolve


class Entry:
    """One layout's staged function, and what its calls learned."""

    __slots__ = ("info", "layout", "placed", "staged")

    def __init__(self, layout: Layout, staged: Any):
        self.layout, self.staged = layout, staged
        self.placed = False  # the Variables were placed onto the plan by a successful call
        self.info: TraceInfo | None = None  # what the last successful call's trace found


def run(entry: Entry, staged: Any, call: Call) -> Any:
    """Call `staged`; then, all or nothing, write back and rebuild graph nodes in the output.

    The first call of a layout also places Variables onto the plan, once it
    has succeeded.
    """
    layout = entry.layout
    values = layout.split.gather()
    placed = None if entry.placed else onto(values, layout.var_shardings)
    inputs = layout.inputs(placed or values, call)
    if layout.donated:
        _refuse_shared_donation(layout, inputs)
    try:
        outputs = staged(*inputs)
    except Exception as error:
        return recover(entry, error, staged, values, placed, call)
    return finish(entry, outputs, values, placed, call)


def recover(
    entry: Entry,
    error: Exception,
    staged: Any,
    values: Sequence[Any],
    placed: Sequence[Any] | None,
    call: Call,
) -> Any:
    """`staged` raised `error` on `values` (or `placed`): the output of the call made
    again if a Variable was given an array on another sharding since (JAX refuses
    those; it is moved back to the plan's), else `error` raised with the caller's
    names. Any other argument JAX refuses is named in the error, never moved (unless the
    backend reshards arguments, as `jax.shard_map` does)."""
    layout = entry.layout
    held = [*values, *(call.leaves[i] for i in layout.checked_leaves)]
    if isinstance(error, ValueError) and held_types(held) != layout.held:
        # JAX refused, before tracing, a value of another shape than the one a plan
        # resolved its spec for (a call like the last skipped the lookup): a new layout
        raise StaleLayout(f"{layout.names.function} was called with values of new shapes")
    try:
        if not isinstance(error, ValueError):
            raise error
        resharded = misplaced_leaves(layout, call)
        moved = onto(placed or values, layout.var_shardings)
        if moved is None and resharded is call:
            raise error
        outputs = staged(*layout.inputs(moved or placed or values, resharded))
    except Exception as final:
        if layout.donated:
            _note_consumed(layout, final, values)
        if final is error:  # raised by the staged function, not by meshlift's checks
            names = layout.names
            final.add_note(
                f"raised while backend {names.backend!r} ({names.origin}) ran {names.function}"
            )
        explain(layout, final, call)
        raise
    return finish(entry, outputs, values, moved, call)


def finish(
    entry: Entry, outputs: Any, values: Sequence[Any], placed: Sequence[Any] | None, call: Call
) -> Any:
    """Write the staged `outputs` back (the arguments held `values`, `placed` if moved
    onto the plan) and give the caller's output."""
    var_out, extra, user_out, aux = outputs
    info = aux.info
    statics = info.statics(entry.layout.split)
    index_map = _write_back(entry.layout, info, values, placed, var_out, extra, call, statics)
    entry.placed = True
    entry.info = info
    return info.decode(user_out, index_map, statics)


def placed_inputs(layout: Layout, call: Call) -> tuple[tuple[Any, ...], ...]:
    """The inputs with every Variable on its planned sharding, written nowhere (for stages)."""
    call = misplaced_leaves(layout, call)
    values = layout.split.gather()
    return layout.inputs(onto(values, layout.var_shardings) or values, call)


def eval_shape(entry: Entry, call: Call) -> Any:
    """The call's output shapes and dtypes, graph outputs as abstract modules."""
    return abstract_outputs(entry.staged, entry.layout, call)[0]


def misplaced_leaves(layout: Layout, call: Call) -> Call:
    """`call` itself, or, where an argument array is committed to a sharding other than
    its spec's: a refusal naming it (`jax.jit` refuses it too; meshlift does not move
    the caller's arrays), or for a backend that reshards arguments as `jax.shard_map`
    does, a copy of `call` with those arrays resharded onto their specs."""
    moved: dict[int, jax.Array] = {}
    for pos in layout.dyn_pos:
        leaf, sharding = call.leaves[pos], layout.dyn_shardings[pos]
        if (
            sharding is None
            or not isinstance(leaf, jax.Array)
            or isinstance(leaf, jax.core.Tracer)
            or not compat.is_committed(leaf)
            or leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        ):
            continue
        if layout.reshards_arguments:
            moved[pos] = jax.device_put(leaf, sharding)
            continue
        spec = getattr(sharding, "spec", sharding)
        mesh = resolve.mesh_shape(getattr(sharding, "mesh", None))
        raise ValueError(
            f"`{format_path(layout.leaf_paths[pos])}` (shape {leaf.shape}) is committed to "
            f"{leaf.sharding}, but {layout.names.in_specs} gives it {spec} on mesh {mesh}. "
            f"JAX refuses an argument laid out otherwise, and meshlift does not move your "
            f"arrays: put it there first (`jax.device_put(x, NamedSharding(mesh, {spec}))`), "
            f"or change its spec"
        )
    if not moved:
        return call
    leaves = [moved.get(i, leaf) for i, leaf in enumerate(call.leaves)]
    return Call(leaves, call.nodes, call.fixed_structure)


def _refuse_shared_donation(layout: Layout, inputs: tuple[tuple[Any, ...], ...]) -> None:
    """Refuse, naming both, a donated array that another input holds too (two Params
    of one array, say): JAX cannot donate a buffer twice, nor read one it donated."""
    if speedups.donated_alone(inputs):
        return
    donated = {id(value) for value in (*inputs[2], *inputs[3])}
    first: dict[int, str] = {}
    for name, value in zip(layout.input_names(), itertools.chain(*inputs), strict=True):
        if isinstance(value, jax.Array) and id(value) in first and id(value) in donated:
            raise ValueError(
                f"`{first[id(value)]}` and `{name}` hold the same array, and it is donated "
                f"to {layout.names.function} (shape {value.shape}): JAX cannot donate one "
                f"buffer twice or read a buffer it donated. Give one of them its own copy "
                f"(`jnp.copy`), or do not donate it. Nothing was changed."
            )
        first.setdefault(id(value), name)


def _write_back(
    layout: Layout,
    info: TraceInfo,
    values: Sequence[Any],
    placed: Sequence[Any] | None,
    var_out: Sequence[Any],
    extra: Sequence[Any],
    call: Call,
    statics: Any,
) -> Any:
    """Validate every write, then make them (the caller's `statics` in a new graph); the
    index map to decode outputs with."""
    split = layout.split
    if info.update is not None and call.fixed_structure:
        raise StructureChangedError(
            f"{layout.names.function} changed the structure of its arguments (a new, "
            f"replaced or deleted attribute) under nnx.cached_partial, which keeps the "
            f"structure it was given, as under nnx.jit: nothing was written back. Change "
            f"only values there, or call the lifted function without cached_partial."
        )
    if info.update is not None:
        leaves = info.update.leaves(var_out, extra)
        detached = info.update.detached  # given new values, then left out of the graph
        _check_no_leak(layout, leaves, info.update.sources, info.update.paths)
        _check_no_leak(layout, [var_out[i] for i in detached], detached)
        index_map = info.update.apply(leaves, split.index_map(call.nodes), statics)
        split.scatter(detached, [var_out[i] for i in detached], call.nodes)
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
        _check_no_leak(layout, new, positions)
        split.scatter(positions, new, call.nodes)
    return split.index_map(call.nodes) if info.outputs.graphdefs else None


def _check_no_leak(
    layout: Layout,
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
    leaves = layout.split.leaves
    traced = [j for j, value in enumerate(new) if isinstance(value, tracer)]
    model_outside = not all(map(_updatable, leaves))
    outside = [
        layout.caller_path(layout.split.paths[i] if i is not None else new_paths[j])  # type: ignore[index]
        for j in traced
        if ((i := positions[j]) is None and model_outside)
        or (i is not None and not _updatable(leaves[i]))
    ]
    if outside:
        shown = listing(format_path(path) for path in outside)
        function = layout.names.function
        raise TraceLeakError(
            f"{function} was called inside an outer JAX transform (jax.jit, "
            f"lax.scan, jax.grad, jax.vmap...) and would write that transform's tracers "
            f"into {shown}, which live outside it. Nothing was written. Pass the "
            f"model through the outer transform (nnx.jit, nnx.scan, nnx.grad, nnx.vmap, or "
            f"nnx.split/nnx.merge around jax.jit) so its state flows through it, or call "
            f"{function} outside the transform."
        )


def _note_consumed(layout: Layout, error: Exception, values: Sequence[Any]) -> None:
    """Name the caller's Variables whose donated arrays a failed call deleted."""
    deleted = [i for i, v in enumerate(values) if _is_deleted(v)]
    if deleted:
        names = [format_path(layout.variable_path(i)) for i in deleted]
        error.add_note(
            f"{layout.names.function} failed after its donated arrays were given to the "
            f"computation: {listing(names)} now hold deleted arrays, as under jax.jit. "
            f"Restore them (from a checkpoint or a copy) before using the model again."
        )


def onto(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any] | None:
    """`values` with each array not on its sharding moved there (every array of a value
    that is a pytree, where one is not); None if none had to move.

    Tracers (an outer trace) are never moved: they are not the caller's arrays.
    """
    misplaced = [
        i
        for i, (value, sharding) in enumerate(zip(values, shardings, strict=True))
        if sharding is not None and _misplaced(value, sharding)
    ]
    if not misplaced:
        return None
    # One value held twice and placed alike is moved once, and stays one value.
    first = {(id(values[i]), shardings[i]): i for i in reversed(misplaced)}
    unique = sorted(first.values())
    flat = [
        jax.tree.flatten(values[i][...] if compat.is_ref(values[i]) else values[i]) for i in unique
    ]
    arrays = [leaf for leaves, _ in flat for leaf in leaves]
    targets = [shardings[i] for i, (leaves, _) in zip(unique, flat, strict=True) for _ in leaves]
    moved = jax.device_put(arrays, targets)
    if isinstance(moved[0], jax.core.Tracer):  # device_put was staged into an outer trace
        return None
    own = iter(map(_own_buffers, moved, arrays))
    placed_once = {}
    for i, (leaves, treedef) in zip(unique, flat, strict=True):
        value = jax.tree.unflatten(treedef, [next(own) for _ in leaves])
        placed_once[i] = compat.new_ref(value) if compat.is_ref(values[i]) else value
    placed = list(values)
    for i in misplaced:
        placed[i] = placed_once[first[id(values[i]), shardings[i]]]
    return placed


def _misplaced(value: Any, sharding: Any) -> bool:
    """Whether `value` (an array or reference, or each array of a pytree) is off `sharding`;
    a tracer never is."""
    if isinstance(value, jax.core.Tracer):
        return False
    if hasattr(value, "sharding"):
        return bool(value.sharding != sharding)
    leaves = jax.tree.leaves(value)
    if len(leaves) == 1 and leaves[0] is value:  # a number, a NumPy array: never placed
        return False
    return any(_misplaced(leaf, sharding) for leaf in leaves)


def _own_buffers(moved: jax.Array, source: jax.Array) -> jax.Array:
    """`moved` (`source` put onto a sharding), moved again from a copy of `source` if it
    shares a buffer with it: `jax.device_put` reuses the source's buffer for a replica on
    its device (`may_alias=False` notwithstanding, jax 0.10). Another input may still
    hold `source`, and XLA cannot donate a buffer it also reads (jaxlib crashes)."""
    if not isinstance(source, jax.Array):  # a NumPy array or a number: a new buffer anyway
        return moved
    held = {shard.data.unsafe_buffer_pointer() for shard in source.addressable_shards}
    if all(shard.data.unsafe_buffer_pointer() not in held for shard in moved.addressable_shards):
        return moved
    return jax.device_put(jnp.copy(source), moved.sharding)


def _updatable(leaf: Any) -> bool:
    """Whether `leaf` may take a value of the current trace: a Variable flax lets update,
    or an array stored on a module that is itself a tracer (the module lives in the trace)."""
    if hasattr(leaf, "get_raw_value"):  # a Variable
        return compat.can_update(leaf)
    return isinstance(leaf, jax.core.Tracer)


def _is_deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
