"""`ml.explain`: what a plan does to every parameter, checked before anything compiles.

One row per array: path, shape, dtype, spec, shards, bytes per device; the
total per device against the unsharded total; warnings for large replicated
parameters and for plan filters that matched nothing; and every problem (an
axis the mesh lacks, an axis used twice, a spec longer than the rank, a
dimension not divisible) with its path. Only shapes and metadata are read, so
an abstract model (`nnx.eval_shape`, `jax.eval_shape`) and a mesh given as
`{"data": 2, "model": 4}` work without the devices.

Example:

```python
from flax import nnx
from jax.sharding import PartitionSpec as P
import meshlift as ml

model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
report = ml.explain(model, plan, {"data": 2, "model": 4})
print(report)               # a rich table
report.check()              # raises ml.PlanError listing every problem
report.show("kernel")       # a picture: which devices hold which block of the kernel
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from meshlift.errors import PlanError
from meshlift.paths import format_path
from meshlift.plans import resolve
from meshlift.plans.annotation import annotated_leaves, unused_rules_of
from meshlift.plans.mesh import current_mesh
from meshlift.plans.sharding import Spec, StateSharding, as_plan
from meshlift.plans.specs import spec_axes
from meshlift.tools.blocks import Blocks, mesh_of_devices, spec_entry
from meshlift.tools.tables import Breakable, fit_columns
from meshlift.tools.why import Why, of_annotation, of_filter

if TYPE_CHECKING:
    from meshlift.plans.logical import Rules

LARGE_REPLICATED_BYTES = 1 << 20  # warn about replicated parameters from 1 MiB


@dataclasses.dataclass(frozen=True)
class Row:
    """One array: where it is, what it is, how the plan shards it, and what is wrong.

    Attributes:
        path: The array's path, `"linear1.kernel"`.
        shape: Its shape.
        dtype: Its dtype's name.
        spec: The `PartitionSpec` the plan gives it; None: left to the compiler.
        shards: How many blocks the spec cuts it into.
        bytes: Its size unsharded.
        bytes_per_device: The size of one block.
        problems: What keeps the spec from fitting the array and the mesh; empty if none.
        own_mesh: The mesh of the `NamedSharding` the plan gives, if it gives one.
        why: What decided the spec, and why each dimension is split or not.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec | None
    shards: int
    bytes: int
    bytes_per_device: int
    problems: tuple[str, ...] = ()
    #: The mesh of the NamedSharding the plan gives, where it gives one (`layout` draws on it).
    own_mesh: Mesh | None = dataclasses.field(default=None, compare=False, repr=False)
    why: Why = dataclasses.field(default=Why("none", ""), compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The result of `ml.explain`: rows, totals, warnings and problems; prints as a table.

    `layout(path)` and `show(path)` draw where the blocks of one parameter live.

    Attributes:
        mesh_shape: The mesh's `{axis: size}`.
        rows: One `Row` per array, in path order.
        warnings: Large replicated arrays, plan filters that matched nothing, arrays
            placed on another mesh.
        mesh: The `Mesh` explained on, if one was given or in context.
    """

    mesh_shape: dict[str, int]
    rows: tuple[Row, ...]
    warnings: tuple[str, ...]
    #: The Mesh explained on, if one was given (or in context); `layout` uses its devices.
    mesh: Mesh | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def problems(self) -> list[tuple[str, str]]:
        """`(path, problem)` for every problem of every row."""
        return [(row.path, p) for row in self.rows for p in row.problems]

    @property
    def ok(self) -> bool:
        """True if no row has a problem."""
        return not self.problems

    @property
    def total_bytes(self) -> int:
        """The size of every array, unsharded."""
        return sum(row.bytes for row in self.rows)

    @property
    def bytes_per_device(self) -> int:
        """The size of one block of every array: what each device holds."""
        return sum(row.bytes_per_device for row in self.rows)

    def check(self) -> Explanation:
        """Raise one `ml.PlanError` listing every problem; return self if there are none.

        Returns:
            This `Explanation`.

        Raises:
            meshlift.PlanError: Listing every problem, by path, if there is one.
        """
        if self.problems:
            raise PlanError(
                f"the plan does not fit {len(self.problems)} time(s) on mesh {self.mesh_shape}:\n  "
                + "\n  ".join(
                    f"`{row.path}` (shape {row.shape}, spec {row.spec}): {p}"
                    for row in self.rows
                    for p in row.problems
                )
            )
        return self

    def row(self, path: str) -> Row:
        """The row of the parameter at `path` (`"linear1.kernel"`).

        A path that is not in the table raises `LookupError` naming the paths
        closest to it; the last part of a path alone (`"kernel"`) is enough
        when only one parameter ends with it.

        Args:
            path: A parameter's dotted path, or the end of one.

        Returns:
            Its `Row`.

        Raises:
            LookupError: If no path, or more than one, ends with `path`.
        """
        paths = [r.path for r in self.rows]
        if path in paths:
            return self.rows[paths.index(path)]
        ending = [p for p in paths if p.endswith(f".{path}")]
        if len(ending) == 1:
            return self.rows[paths.index(ending[0])]
        near = list(dict.fromkeys([*ending, *difflib.get_close_matches(path, paths, n=5)]))[:5]
        raise LookupError(
            f"no parameter {path!r} on this plan; "
            + (f"did you mean {' or '.join(near)}?" if near else f"its paths are {_few(paths)}")
        )

    def why(self, path: str) -> str:
        """What decided the spec of the parameter at `path`, and why each dimension is split
        or not: the filter, rules or annotation, and per dimension the reason.

        Args:
            path: A parameter's dotted path, or the end of one (as for `row`).

        Returns:
            A few lines of text: the parameter, what decided its spec, one line per
                dimension, and notes (a later filter that matches too, a rule that does
                nothing, a problem).

        Raises:
            LookupError: If no single parameter has that path.

        Example:

        ```python
        init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        model = nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))
        report = ml.explain(model, [("embed", None), ("mpl", "model")], {"data": 2, "model": 4})
        print(report.why("kernel"))   # dim 1 (size 64): not split, no rule names 'mlp' ...
        ```
        """
        row = self.row(path)
        spec = "left to the compiler" if row.spec is None else str(row.spec)
        lines = [
            f"{row.path}: shape {row.shape} {row.dtype}, {spec}, on mesh {self.mesh_shape}",
            str(row.why),
        ]
        lines += [f"problem: {p}" for p in row.problems]
        return "\n".join(lines)

    def layout(self, path: str) -> Blocks:
        """Which devices hold which block of the parameter at `path`; prints as a picture.

        Computed as JAX places the array: from the `NamedSharding` of its spec on
        the mesh, `sharding.devices_indices_map(shape)`. The mesh is the one
        given to `ml.explain`; a mesh given as `{"data": 2, "model": 4}` is laid
        over the first devices as `ml.make_mesh` would (on CPU, over simulated
        devices: set `XLA_FLAGS=--xla_force_host_platform_device_count=8`).

        Args:
            path: A parameter's dotted path, or the end of one (as for `row`).

        Returns:
            A `Blocks` picture of the array's blocks, each labelled with its devices.

        Raises:
            LookupError: If no single parameter has that path.
            meshlift.PlanError: If the row has a problem, or its spec is no
                `PartitionSpec` on the mesh.

        Example:

        ```python
        model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
        plan = ml.StateSharding({ml.path_endswith("kernel"): P("data", "model"), ...: P()})
        layout = ml.explain(model, plan, ml.make_mesh({"data": 2, "model": 4})).layout("kernel")
        assert layout.grid() == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
        print(layout)       # 2 x 4 blocks of (8, 8), each labelled with its device
        ```
        """
        row = self.row(path)
        if row.problems:
            raise PlanError(f"cannot draw `{row.path}`: {row.problems[0]}")
        if row.spec is None:
            raise PlanError(
                f"cannot draw `{row.path}`: its sharding is not a PartitionSpec on the mesh "
                f"(it is left to the compiler, or another kind of jax Sharding)"
            )
        mesh = row.own_mesh or self.mesh or mesh_of_devices(self.mesh_shape)
        return Blocks.of(row.path, row.shape, row.dtype, row.spec, mesh)

    def show(self, *paths: str, console: Console | None = None) -> None:
        """Print `layout(path)` for each path: blocks of the array labelled with device ids.

        In the spirit of `jax.debug.visualize_array_sharding`, for a plan that has
        not run: nothing is allocated or compiled.

        Args:
            *paths: Parameters' paths, as for `row`.
            console: The `rich` console to print on; None: a new one (stdout).

        Raises:
            LookupError: If no single parameter has one of the paths.
            meshlift.PlanError: As `layout`.
        """
        console = console or Console()
        for path in paths:
            console.print(self.layout(path))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `--json`.

        Returns:
            A dict of lists, strings and numbers: `mesh`, `rows`, `total_bytes`,
                `bytes_per_device`, `warnings` and `problems`.
        """
        return {
            "mesh": self.mesh_shape,
            "rows": [
                {
                    "path": r.path,
                    "shape": list(r.shape),
                    "dtype": r.dtype,
                    "spec": None if r.spec is None else [spec_entry(e) for e in r.spec],
                    "shards": r.shards,
                    "bytes": r.bytes,
                    "bytes_per_device": r.bytes_per_device,
                    "problems": list(r.problems),
                    "source": r.why.source,
                    "why": {
                        "decided_by": r.why.decided_by,
                        "dimensions": list(r.why.dimensions),
                        "notes": list(r.why.notes),
                    },
                }
                for r in self.rows
            ],
            "total_bytes": self.total_bytes,
            "bytes_per_device": self.bytes_per_device,
            "warnings": list(self.warnings),
            "problems": [{"path": path, "problem": p} for path, p in self.problems],
        }

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self._rendered(options.max_width)

    def _rendered(self, width: int) -> Group:
        devices = math.prod(self.mesh_shape.values())
        table = Table(
            "path",
            "array",
            "spec",
            "source",
            "per device",
            title=f"plan on mesh {self.mesh_shape} ({devices} devices)",
        )
        for column in table.columns:  # a narrow terminal folds long cells, never cuts them
            column.overflow = "fold"
        for r in self.rows:
            table.add_row(
                Breakable(("✗ " if r.problems else "") + r.path, "red" if r.problems else ""),
                Breakable(_short_type(r.dtype, r.shape)),
                Breakable("auto" if r.spec is None else str(r.spec)),
                r.why.source,
                _size(r.bytes_per_device),
            )
        fit_columns(table, width)
        ratio = self.total_bytes / self.bytes_per_device if self.bytes_per_device else 1.0
        lines = [
            Text(
                f"total per device: {_size(self.bytes_per_device)} of "
                f"{_size(self.total_bytes)} unsharded ({ratio:.2f}x smaller)"
            )
        ]
        lines += [Text(f"warning: {w}", style="yellow") for w in self.warnings]
        if self.problems:
            lines.append(Text(f"{len(self.problems)} problem(s):", style="bold red"))
            lines += [Text(f"  {path}: {p}", style="red") for path, p in self.problems]
        else:
            lines.append(Text("no problems: every spec fits its array and the mesh"))
        return Group(table, *lines)

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=120, color_system=None, highlight=False).print(self)
        return buffer.getvalue()


def explain(
    model_or_tree: Any,
    plan_or_rules: StateSharding | Mapping[Any, Any] | PartitionSpec | Rules | None = None,
    mesh: Mesh | Mapping[str, int] | None = None,
    *,
    large_replicated_bytes: int = LARGE_REPLICATED_BYTES,
) -> Explanation:
    """Explain a plan on a mesh, one row per array, validating without compiling.

    `plan_or_rules` is a `StateSharding`, a nested mapping / `nnx.State` of
    specs, one `PartitionSpec` for everything, a list of logical axis rules
    applied to the model's annotations, or None for the annotations as they
    are. `mesh` is a Mesh or `{"data": 2, "model": 4}`; default: the mesh of
    `ml.use_mesh`. Print the result for the table; `.check()` raises.

    Args:
        model_or_tree: A module, `nnx.State`, variable dict or abstract tree.
        plan_or_rules: The plan, the axis rules, or None (see above).
        mesh: A Mesh or `{"data": 2, "model": 4}`; None: the mesh of `ml.use_mesh`.
        large_replicated_bytes: Warn about replicated arrays from this size on (1 MiB).

    Returns:
        The `Explanation`; problems are in it, not raised.

    Raises:
        TypeError: If there is no mesh, or `plan_or_rules` is none of the above.

    Example:

    ```python
    mesh = {"data": 2, "model": 4}            # or a Mesh
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    print(ml.explain(model, plan, mesh))

    init = ml.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    abstract_variables = nnx.eval_shape(
        lambda: nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
    )
    print(ml.explain(abstract_variables, [("batch", "data"), ("hidden", "model")], mesh))
    ```
    """
    mesh_shape = _mesh_shape(mesh)
    concrete = mesh if isinstance(mesh, Mesh) else current_mesh() if mesh is None else None
    items = annotated_leaves(model_or_tree)
    plan, rules = _plan_and_rules(plan_or_rules)
    unused: dict[Any, list[str]] = {}
    notes: list[str] = []
    if plan is None:
        typos, names = unused_rules_of(items, rules, mesh_shape)
        for rule, paths in typos.items():
            for where in paths:
                unused.setdefault(where, []).append(
                    f"{rule}; it is less sharded than the rule asks"
                )
        if names:
            notes.append(
                f"the rules name {', '.join(map(repr, names))}, which no parameter has: fine "
                f"for activations (ml.with_logical_constraint), else check the names"
            )
    matched = _matched(plan, items)
    placements = [_placed(item, plan, rules, mesh_shape, matched) for item in items]
    rows = []
    for item, (placed, own_mesh, why) in zip(items, placements, strict=True):
        path = format_path(item.array_path)
        if placed.mesh_shape != mesh_shape:
            notes.append(f"`{path}` is placed on its NamedSharding's mesh, {placed.mesh_shape}")
        if f"`{format_path(item.path)}`" in unused:
            placed = dataclasses.replace(
                placed, problems=(*placed.problems, *unused[f"`{format_path(item.path)}`"])
            )
        rows.append(_row(path, item, placed, own_mesh, why))
    return Explanation(
        mesh_shape,
        tuple(rows),
        (*notes, *_warnings(rows, plan, matched, mesh_shape, large_replicated_bytes)),
        mesh=concrete,
    )


def _placed(
    item: Any, plan: StateSharding | None, rules: Any, mesh_shape: dict[str, int], matched: set
) -> tuple[resolve.Placement, Mesh | None, Why]:
    """How a call places `item` (the rule it takes, or the error it raises), the mesh of
    the NamedSharding it is given, if any, and why. `matched`: the plan's rules that match
    any parameter."""
    spec: Spec
    skipped: list[Any] = []
    try:
        if plan is None:
            decision = item.decide(rules, mesh_shape)
            spec, skipped = decision.spec, decision.skipped
            why = of_annotation(
                item.names,
                decision.by_rules,
                decision.spec,
                decision.causes,
                item.shape,
                mesh_shape,
            )
        else:
            index = plan.rule_for(item.path, item.holder)
            spec = plan.rules[index][2]
            why = of_filter(plan, index, item.path, item.holder, item.shape, mesh_shape, matched)
    except PlanError as error:
        problem = str(error) if plan is not None else needs_rules(item, mesh_shape)
        placed = resolve.Placement(PartitionSpec(), mesh_shape, (problem,))
        return placed, None, Why("error", "nothing: the parameter has a problem (below)")
    own = spec.mesh if isinstance(spec, NamedSharding) else None
    placed = resolve.placement(spec, mesh_shape, item.shape)
    if skipped:  # a rule naming an axis the mesh lacks: a typo, or rules for another mesh
        placed = dataclasses.replace(
            placed,
            problems=(
                *(f"{rule}; it is less sharded than the rule asks" for rule in skipped),
                *placed.problems,
            ),
        )
    return placed, own if isinstance(own, Mesh) else None, why


def _matched(plan: StateSharding | None, items: list[Any]) -> set[int]:
    """The indices of the plan's rules that match some parameter."""
    matched: set[int] = set()
    if plan is None:
        return matched
    for item in items:
        with contextlib.suppress(PlanError):
            matched.add(plan.rule_for(item.path, item.holder))
    return matched


def needs_rules(item: Any, mesh_shape: Mapping[str, int]) -> str:
    """The problem of an array with logical names and no rules: Python advice, with an
    example rule built from the array's own names and the mesh's axes (`meshlift plan`
    gives its own, for --rules)."""
    names = [n for n in item.names if isinstance(n, str)]
    example = f"[({names[-1]!r}, {list(mesh_shape)[-1]!r})]" if names and mesh_shape else "[...]"
    return (
        f"it has the logical names {item.names} but no axis rules are set; pass the "
        f"rules as the plan, e.g. {example}, or use ml.axis_rules"
    )


def _row(path: str, item: Any, placed: resolve.Placement, own_mesh: Mesh | None, why: Why) -> Row:
    spec, mesh_shape, problems = placed.spec, placed.mesh_shape, placed.problems
    shape = item.shape
    dtype = _dtype(item.value)
    itemsize = dtype.itemsize
    total = math.prod(shape) * itemsize
    per_dim = [1] * len(shape)
    shards = 1
    if spec is not None:
        for dim, axes in spec_axes(spec):
            size = math.prod(mesh_shape.get(a, 1) for a in axes)
            shards *= size
            if dim < len(shape):
                per_dim[dim] = size
    per_device = math.prod(-(-n // k) for n, k in zip(shape, per_dim, strict=True)) * itemsize
    return Row(
        path,
        shape,
        str(dtype),
        spec,
        shards,
        total,
        per_device,
        tuple(dict.fromkeys(problems)),
        own_mesh,
        why,
    )


def _dtype(value: Any) -> Any:
    """`value`'s dtype, JAX's own (`key<fry>` for an RNG key) included; a Python number's
    as NumPy gives it."""
    dtype = getattr(value, "dtype", None)
    return np.asarray(value).dtype if dtype is None else dtype


def _warnings(
    rows: list[Row],
    plan: StateSharding | None,
    matched: set[int],
    mesh_shape: dict[str, int],
    threshold: int,
) -> tuple[str, ...]:
    out = []
    if math.prod(mesh_shape.values()) > 1:
        for r in rows:
            if r.shards == 1 and r.bytes >= threshold:
                out.append(
                    f"`{r.path}` ({_size(r.bytes)}) is replicated on every device; "
                    f"shard one of its dimensions to save memory"
                )
    if plan is not None:
        for index, (filter_, _, spec) in enumerate(plan.rules):
            if index not in matched and filter_ is not Ellipsis:
                out.append(f"the plan's filter {filter_!r} (spec {spec}) matched no parameter")
    return tuple(out)


def _plan_and_rules(plan_or_rules: Any) -> tuple[StateSharding | None, Any]:
    """Split the argument into a plan, or rules for the annotations (None: the context's)."""
    p = as_plan(plan_or_rules)
    if p is None:
        return None, None
    if isinstance(p, StateSharding):
        return p, None
    if isinstance(p, PartitionSpec | Sharding):
        return StateSharding({...: p}), None
    if isinstance(p, Mapping):
        return StateSharding.from_state(p), None
    if isinstance(p, Sequence) and not isinstance(p, str):
        return None, p  # axis rules: checked by the first lookup
    raise TypeError(
        f"explain takes a StateSharding (meshlift's or flax's), a mapping of specs, a "
        f"PartitionSpec or a list of axis "
        f"rules; got {type(p).__name__}: {p!r}"
    )


def _mesh_shape(mesh: Any) -> dict[str, int]:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise TypeError(
            "explain needs a mesh: pass a Mesh or a shape like {'data': 2, 'model': 4}, or "
            "call it inside `with ml.use_mesh(mesh):`"
        )
    return dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)


def _short_type(dtype: str, shape: tuple[int, ...]) -> str:
    """An array's type as jax writes it in a jaxpr: `f32[16,64]`, `bf16[]`."""
    short = dtype.replace("float", "f").replace("uint", "u").replace("int", "i")
    return f"{short.replace('complex', 'c')}[{','.join(map(str, shape))}]"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
