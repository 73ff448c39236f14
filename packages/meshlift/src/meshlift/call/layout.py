"""An argument layout: where each graph node sits among a call's arguments, and what follows.

A `Layout` is made on a cache miss and never changed after: the argument
leaves' paths in the caller's names, the split of the graph nodes into
Variables, one sharding per Variable and per other leaf, which inputs are
donated, what passes through unchanged, and `key`, everything the staged
function is made of besides its arrays (never an identity). Its methods
only read it: the staged function's four inputs for a call, and the
caller's path of any staged input.

Example:

```python
from meshlift.call.arguments import Signature
from meshlift.call.layout import Call, Layout, Names, flatten_arguments

def step(model, batch, lr):
    return model(batch["x"]) * lr

signature = Signature(step, static_argnames="lr", donate_argnames="batch")
model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
args, kwargs, statics = signature.pop_statics(
    (model,), {"batch": {"x": jnp.ones((1, 2))}, "lr": 0.1}
)
leaves, treedef = flatten_arguments(args, kwargs)
layout = Layout(args, kwargs, Call(leaves, (model,)), treedef, statics, None, step,
                signature=signature, names=Names("step"))
assert [layout.leaf_paths[i] for i in layout.dyn_pos] == [("batch", "x")]
assert layout.dyn_groups == ((), (1,))       # batch.x is donated, the model is not
assert layout.variable_path(1) == ("model", "kernel")
```
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import jax
import numpy as np
from flax import nnx

from meshlift import compat
from meshlift.call import static_changes
from meshlift.call.arguments import Signature, static_key
from meshlift.call.pure import PureFunction, abstract_outputs, held_types, picker
from meshlift.call.staged_errors import names_note
from meshlift.errors import PlanError
from meshlift.graph.split import GraphSplit, is_graph_leaf, is_graph_type, raw
from meshlift.graph.structure import per_type
from meshlift.paths import Path, format_path, key_name
from meshlift.plans import resolve
from meshlift.plans.sharding import StateSharding

# jax.jit aliases a mutable array reference to an output of its own, and may give a donated
# buffer that same output: XLA then fails (seen on jax 0.10.2). Donation is a hint.
_REF_DONATION = (
    "{} takes ref=True Variables (mutable array references), so nothing is donated on this "
    "call: XLA can fail to alias a donated buffer beside a reference (jax 0.10). Donate in "
    "calls without references, or make those Variables plain"
)


@attrs.frozen
class Names:
    """The words errors use for a lifted function: its name, its front end's names for
    the argument and output specs (`in_shardings`, `out_specs`...), and its backend's
    name and origin (`meshlift-jit 0.1.0`)."""

    function: str
    in_specs: str = "in_specs"
    out_specs: str = "out_specs"
    backend: str = "jit"
    origin: str = "registered in this process"


class Call:
    """One call's argument leaves (graph nodes are leaves) and its graph nodes.

    `fixed_structure`: made by `nnx.cached_partial`, whose nodes are copies of the
    caller's sharing its Variables, so only new values can reach the caller.
    `flat_positions`: where the graph nodes are among the arguments, if each argument
    is a leaf and none is static or a keyword (a call like it may skip the lookup).
    """

    __slots__ = ("fixed_structure", "flat_positions", "leaves", "nodes")

    def __init__(self, leaves: list[Any], nodes: tuple[Any, ...], fixed_structure: bool = False):
        self.leaves, self.nodes, self.fixed_structure = leaves, nodes, fixed_structure
        self.flat_positions: tuple[int, ...] | None = None

    @classmethod
    def of_arguments(cls, args: tuple, positions: tuple[int, ...], fixed: bool = False) -> Call:
        """The call of arguments that are all leaves, graph nodes at `positions`."""
        call = cls(list(args), tuple(map(args.__getitem__, positions)), fixed)
        call.flat_positions = positions
        return call


class Layout:
    """Everything fixed for one argument layout, from the call that first had it.

    `specs` are the front end's `(in_specs, out_specs)` on `mesh`; `fun` is the
    lifted function, staged as `pure`.
    """

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Call,
        treedef: Any,
        statics: tuple[Any, ...],
        mesh: Any,
        fun: Callable[..., Any],
        *,
        signature: Signature,
        names: Names,
        specs: tuple[Any, Any] = (None, None),
        passes_through_none: bool = False,
        reshards_arguments: bool = False,
    ):
        self.treedef, self.statics, self.mesh, self.names = treedef, statics, mesh, names
        self.reshards_arguments = reshards_arguments  # the backend moves committed arrays
        self.signature = signature
        self.in_specs, self.out_specs = specs
        self.arg_count, self.kwarg_names = len(args), tuple(kwargs)
        leaves = call.leaves
        self.node_pos = tuple(i for i, leaf in enumerate(leaves) if is_graph_leaf(leaf))
        self.dyn_pos = tuple(i for i, leaf in enumerate(leaves) if not is_graph_leaf(leaf))
        self.leaf_paths = signature.leaf_paths(args, kwargs, statics)
        node_names = [format_path(self.leaf_paths[i]) for i in self.node_pos]
        self.split = GraphSplit(call.nodes, node_names)
        donated = signature.donated_leaves(args, kwargs, statics)
        if any(donated) and any(compat.is_ref(raw(leaf)) for leaf in self.split.leaves):
            donated = [False] * len(donated)  # XLA cannot alias both: see _REF_DONATION
            warnings.warn(_REF_DONATION.format(names.function), UserWarning, stacklevel=5)
        what = self.names.in_specs
        positional = self.signature.positional_prefix(
            self.in_specs, args, what, self.names.function
        )
        self.var_shardings, self.dyn_shardings, by_plan = resolve.argument_shardings(
            positional,
            args,
            leaves,
            self.leaf_paths,
            self.node_pos,
            self.dyn_pos,
            self.split,
            self.mesh,
            what,
        )
        self.passed = {  # leaf position -> a value handed to the function unchanged
            i: leaves[i]
            for i in self.dyn_pos
            if passes_through_none
            and self.dyn_shardings[i] is None
            and pass_key(leaves[i]) is not ARRAY
        }
        if self.passed:
            self.dyn_pos = tuple(i for i in self.dyn_pos if i not in self.passed)
        passed = tuple((i, pass_key(leaves[i])) for i in self.passed)
        self._check_hashable(passed)

        var_donated = [donated[self.node_pos[top(path)]] for path in self.split.paths]
        self.var_groups = _partition(range(len(self.var_shardings)), var_donated)
        self.dyn_groups = _partition(self.dyn_pos, [donated[i] for i in self.dyn_pos])
        self._pick_dyn = picker(self.dyn_pos)
        self.donated = bool(self.var_groups[1] or self.dyn_groups[1])
        self.in_shardings = (
            tuple(self.var_shardings[i] for i in self.var_groups[0]),
            tuple(self.dyn_shardings[i] for i in self.dyn_groups[0]),
            tuple(self.var_shardings[i] for i in self.var_groups[1]),
            tuple(self.dyn_shardings[i] for i in self.dyn_groups[1]),
        )
        self.donate_argnums = (2, 3) if self.donated else ()
        values = self.split.gather()
        # What the shardings were resolved for: each Variable's value, and each other leaf
        # a plan resolved (`PureFunction` checks the values it is traced for against it).
        self.checked_leaves = tuple(i for i in by_plan if i in self.dyn_pos)
        self.held = held_types([*values, *(leaves[i] for i in self.checked_leaves)])
        # Everything the pure function is made of besides its arrays: where the graph nodes
        # sit, which leaves are donated, static values by type; never an identity.
        self.key = (
            self.split.key,
            treedef,
            static_key(statics),
            self.node_pos,
            self.var_groups,
            self.dyn_groups,
            self.in_shardings,
            self.donate_argnums,
            mesh,
            passed,
            self.held,  # what each Variable holds: its shardings and names are for that
        )
        self.fun = fun
        self.pure = PureFunction(fun, self, self.input_names(values))

    def _check_hashable(self, passed: tuple[tuple[int, Any], ...]) -> None:
        for i, value in passed:
            try:
                hash(value)
            except TypeError as e:
                raise TypeError(
                    f"`{format_path(self.leaf_paths[i])}` ({type(value[1]).__name__}) passes "
                    f"through {self.names.function} unchanged (its spec is None and it is not "
                    f"an array), so it is compiled in like a static argument and must be "
                    f"hashable; pass a tuple or a frozen dataclass, or an array with a spec"
                ) from e

    def out_shardings(self, call: Call) -> Any:
        """The output's shardings; a plan for output modules is resolved on an abstract trace."""
        names = self.names
        if not any(
            isinstance(s, StateSharding | Mapping) for s in resolve.spec_leaves(self.out_specs)
        ):
            return resolve.simple_shardings(self.out_specs, self.mesh, names.out_specs)
        traced = static_changes.begin()
        try:
            abstract_out, info = abstract_outputs(self.pure, self, call)
        except Exception as e:
            if note := names_note(self, str(e)):
                e.add_note(note)
            raise PlanError(
                f"{names.out_specs} holds a StateSharding, which meshlift resolves by tracing "
                f"{names.function} abstractly, outside the {names.backend} backend; that "
                f"trace failed ({type(e).__name__}: {e}). Give {names.out_specs} as "
                f"PartitionSpecs for this function."
            ) from e
        finally:
            if static_changes.pending():  # undone: the call's own trace makes them again,
                self.pure = PureFunction(self.fun, self, self.pure.input_names)  # not cached
            static_changes.end(traced, keep=False)
        return resolve.output_shardings(
            self.out_specs, abstract_out, info.outputs, self.mesh, names.out_specs
        )

    def inputs(self, values: Sequence[Any], call: Call) -> tuple[tuple[Any, ...], ...]:
        """The staged function's four arguments: kept Variables' `values`, kept other leaves,
        donated Variables' values, donated other leaves."""
        leaves = call.leaves
        if not self.donated:
            return tuple(values), self._pick_dyn(leaves), (), ()
        return (
            tuple(values[i] for i in self.var_groups[0]),
            tuple(leaves[i] for i in self.dyn_groups[0]),
            tuple(values[i] for i in self.var_groups[1]),
            tuple(leaves[i] for i in self.dyn_groups[1]),
        )

    def input_names(self, values: Sequence[Any] | None = None) -> tuple[str, ...]:
        """The caller's name of each staged input, in the order of `inputs`; given the
        Variables' `values`, of each array as JAX counts them: a Variable holding a
        pytree gives one per array in it (`tree.b.0`), the names JAX's messages use."""

        def variable(i: int) -> list[str]:
            here = self.variable_path(i)
            if values is None:
                return [format_path(here)]
            held = jax.tree_util.tree_flatten_with_path(values[i])[0]
            return [format_path((*here, *map(key_name, at))) for at, _ in held]

        (kept_vars, donated_vars), (kept_dyn, donated_dyn) = self.var_groups, self.dyn_groups
        return (
            *(name for i in kept_vars for name in variable(i)),
            *(format_path(self.leaf_paths[i]) for i in kept_dyn),
            *(name for i in donated_vars for name in variable(i)),
            *(format_path(self.leaf_paths[i]) for i in donated_dyn),
        )

    def variable_path(self, i: int) -> Path:
        """The caller's path of the Variable at split position `i`."""
        return self.caller_path(self.split.paths[i])

    def caller_path(self, path: Path) -> Path:
        """A split path (top-level node position first) in the caller's argument names."""
        return (*self.leaf_paths[self.node_pos[top(path)]], *path[1:])

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
            leaves[pos] = as_state(
                {p[1:]: per_variable[i] for i, p in enumerate(paths) if p[0] == k}
            )
        return jax.tree.unflatten(self.treedef, [leaves[i] for i in range(len(leaves))])


def flatten_arguments(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """`jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)`, without a Python callback
    per argument when each is a graph node or an array, as in a training loop's calls."""
    if not kwargs and all(map(_is_top_level_leaf, map(type, args))):
        return list(args), flat_treedef(len(args))
    return jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)


@per_type
def _is_top_level_leaf(cls: type) -> bool:
    return is_graph_type(cls) or issubclass(cls, jax.Array)


@functools.lru_cache(maxsize=64)
def flat_treedef(count: int) -> Any:
    """The tree structure of `((leaf,) * count, {})`."""
    return jax.tree.structure(((0,) * count, {}))


@functools.lru_cache(maxsize=256)
def node_positions(leaf_types: tuple[type, ...]) -> tuple[int, ...]:
    """Where the graph nodes are among leaves of these types (cached: on the per-call path)."""
    return tuple(i for i, cls in enumerate(leaf_types) if is_graph_type(cls))


ARRAY = object()  # pass_key of an array: never passed through


def pass_key(leaf: Any) -> Any:
    """What a leaf that may pass through is compiled in as: its type and value; ARRAY for an
    array (always an input)."""
    if isinstance(leaf, jax.Array | np.ndarray | np.generic) or hasattr(leaf, "__jax_array__"):
        return ARRAY
    return type(leaf), leaf


def top(path: Path) -> int:
    """The top-level node position a split path starts with."""
    first = path[0]
    assert isinstance(first, int)
    return first


def as_state(flat: dict[Path, Any]) -> Any:
    """One graph node's entries by path as an `nnx.State` (a Variable passed alone: its entry)."""
    if list(flat) == [()]:
        return flat[()]
    return nnx.State.from_flat_path(flat)  # type: ignore[arg-type]  # paths of str and int


def _partition(items: Iterable[int], flags: list[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    items = list(items)
    return (
        tuple(i for i, f in zip(items, flags, strict=True) if not f),
        tuple(i for i, f in zip(items, flags, strict=True) if f),
    )
