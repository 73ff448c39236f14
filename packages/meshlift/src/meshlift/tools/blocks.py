"""Which devices hold which block of one array: `ml.explain(...).layout(path)`.

Computed as JAX places the array, from `NamedSharding(mesh, spec)
.devices_indices_map(shape)`; prints as a picture (rich), one cell per
block labelled with its device ids, and draws as an SVG picture (`svg()`).

Example:

```python
from meshlift.tools.blocks import Blocks

mesh = ml.make_mesh({"data": 2, "model": 4})
blocks = Blocks.of("kernel", (16, 32), "float32", P("data", "model"), mesh)
assert blocks.grid() == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
print(blocks)       # 2 x 4 blocks of (8, 8), each labelled with its device
```
"""

from __future__ import annotations

import dataclasses
import html
import io
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rich import box
from rich.align import Align
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from meshlift.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of an array: `(start, stop)` per dimension, and the ids of its devices."""

    index: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Where the blocks of one array live on a mesh: what `Explanation.layout` returns.

    `dims` are the dimensions drawn: rows, then columns (a 1-D array is one
    row of blocks; of a higher-rank array, the dimensions that are split, at
    most two). `grid()` gives the device-id labels as they are drawn.

    Attributes:
        path: The parameter's path, as `ml.explain` writes it (`"linear1.kernel"`).
        shape: The whole array's shape.
        dtype: The array's dtype name.
        spec: Its `PartitionSpec` on the mesh.
        mesh_shape: The mesh's axis sizes, `{"data": 2, "model": 4}`.
        platform: The devices' platform (`"cpu"`, `"gpu"`), as labels show it.
        dims: The dimensions drawn: rows, then columns.
        blocks: Every distinct block: its index range per dimension and its devices.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec
    mesh_shape: dict[str, int]
    platform: str
    dims: tuple[int, ...]
    blocks: tuple[Block, ...]

    @classmethod
    def of(
        cls, path: str, shape: tuple[int, ...], dtype: str, spec: PartitionSpec, mesh: Mesh
    ) -> Blocks:
        """The blocks of the array at `path` under `spec` on `mesh`, as JAX places it.

        Args:
            path: The parameter's path, for the title.
            shape: The array's shape.
            dtype: The array's dtype name, for the title.
            spec: Its `PartitionSpec`.
            mesh: The `jax.sharding.Mesh` it is placed on.

        Returns:
            The blocks, from `NamedSharding(mesh, spec).devices_indices_map(shape)`.

        Raises:
            PlanError: The spec splits more than two dimensions (a picture shows two).
        """
        indices: dict[Any, Any] = dict(NamedSharding(mesh, spec).devices_indices_map(shape))
        holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for device, index in indices.items():
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
            holders.setdefault(bounds, []).append(device.id)
        blocks = tuple(Block(b, tuple(sorted(ids))) for b, ids in sorted(holders.items()))
        split = [d for d in range(len(shape)) if len({b.index[d] for b in blocks}) > 1]
        if len(split) > 2:
            raise PlanError(
                f"cannot draw `{path}`: its spec {spec} splits {len(split)} dimensions "
                f"({', '.join(map(str, split))}) and a picture shows at most two"
            )
        whole = [d for d in range(len(shape)) if d not in split]
        dims = tuple(sorted([*split, *whole][:2] if len(shape) > 2 else range(len(shape))))
        platform = next(iter(indices)).platform
        return cls(path, shape, dtype, spec, dict(mesh.shape), platform, dims, blocks)

    def _edges(self, dim: int | None) -> list[tuple[int, int]]:
        if dim is None:
            return [(0, 1)]
        return sorted({b.index[dim] for b in self.blocks})

    def grid(self) -> list[list[str]]:
        """The label of each block as drawn, row by row: its device ids, `"0,4"`.

        Returns:
            One list per row of blocks, one label per column.
        """
        rows, columns = self._axes()
        found = {
            (
                b.index[rows] if rows is not None else (0, 1),
                b.index[columns] if columns is not None else (0, 1),
            ): b
            for b in self.blocks
        }
        return [
            [",".join(map(str, found[r, c].devices)) for c in self._edges(columns)]
            for r in self._edges(rows)
        ]

    def _axes(self) -> tuple[int | None, int | None]:
        """(row dimension, column dimension); a 1-D array is one row, a scalar one block."""
        if len(self.dims) == 2:
            return self.dims[0], self.dims[1]
        return None, (self.dims[0] if self.dims else None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `meshlift plan --show --json`: every block's index ranges and devices."""
        return {
            "path": self.path,
            "shape": list(self.shape),
            "spec": [spec_entry(e) for e in self.spec],
            "platform": self.platform,
            "dims": list(self.dims),
            "blocks": [
                {"index": [list(i) for i in b.index], "devices": list(b.devices)}
                for b in self.blocks
            ],
        }

    def __rich__(self) -> Group:
        rows, columns = self._axes()
        labels = self.grid()
        row_edges, column_edges = self._edges(rows), self._edges(columns)
        tag = self.platform.upper()
        texts = [[f"{tag} {label}" for label in line] for line in labels]
        # The picture keeps the array's proportions roughly (a character is about 2.5 times
        # as tall as wide), 48 characters wide or 12 lines tall at most, and every block is
        # wide enough for its label.
        widest = max(len(t) for line in texts for t in line) + 2
        least = widest * len(column_edges)
        height_of = self.shape[rows] if rows is not None else 0  # one line for 1-D
        width_of = self.shape[columns] if columns is not None else 1
        total = max(48, least)
        lines = round(total * height_of / (width_of or 1) / 2.5)
        if lines > 12:
            lines = 12
            total = max(least, round(lines * 2.5 * width_of / height_of))
        lines = max(len(row_edges), lines)
        length = (column_edges[-1][1] - column_edges[0][0]) or 1
        widths = [max(widest, round(total * (b - a) / length)) for a, b in column_edges]
        span = (row_edges[-1][1] - row_edges[0][0]) or 1
        heights = [max(1, round(lines * (b - a) / span)) for a, b in row_edges]

        table = Table(show_header=False, show_lines=True, box=box.SQUARE, padding=0)
        for width in widths:
            table.add_column(width=width, justify="center", overflow="fold")
        colours: dict[str, str] = {}
        for line, height in zip(texts, heights, strict=True):
            cells = []
            for text in line:
                colour = colours.setdefault(text, _PALETTE[len(colours) % len(_PALETTE)])
                cells.append(
                    Align(
                        Text(text), align="center", vertical="middle", height=height, style=colour
                    )
                )
            table.add_row(*cells)
        caption = [Text(self._caption())] + ([Text(self._axes_line())] if self.shape else [])
        return Group(Text(self._title(), style="bold"), table, *caption)

    def svg(self) -> str:
        """The picture as an SVG document: the array's blocks to scale, each labelled
        with its device ids, the split dimensions labelled with their mesh axes.

        Returns:
            The SVG document, to write to a `.svg` file or show in a notebook
            (`IPython.display.SVG(blocks.svg())`).

        Example:

        ```python
        from meshlift.tools.blocks import Blocks

        mesh = ml.make_mesh({"data": 2, "model": 4})
        picture = Blocks.of("kernel", (16, 64), "float32", P(None, "model"), mesh).svg()
        assert picture.startswith("<svg") and "split over &#x27;model&#x27; (4)" in picture
        ```
        """
        rows, columns = self._axes()
        row_edges, column_edges = self._edges(rows), self._edges(columns)
        labels = self.grid()
        # The grid keeps the array's proportions within 160..480 x 40..240 pixels, and every
        # block is wide enough for its label (7 pixels a character) and 26 pixels tall.
        height_of = self.shape[rows] if rows is not None else 1
        width_of = self.shape[columns] if columns is not None else 8
        width = max(160, min(480, 480 * width_of / max(width_of, height_of * 2)))
        height = max(40, min(240, width * height_of / width_of))
        label_width = max(len(label) for line in labels for label in line) * 7 + 12
        widths = _scaled(column_edges, max(width, label_width * len(column_edges)), label_width)
        heights = _scaled(row_edges, max(height, 26 * len(row_edges)), 26)
        grid_w, grid_h = sum(widths), sum(heights)
        left, top = 12, (54 if columns is not None else 34)
        colours: dict[str, str] = {}
        shapes = []
        for line, h, y in zip(labels, heights, _starts(top, heights), strict=True):
            for label, w, x in zip(line, widths, _starts(left, widths), strict=True):
                fill = colours.setdefault(label, _FILLS[len(colours) % len(_FILLS)])
                shapes.append(
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                    f'fill="{fill}" stroke="#ffffff" stroke-width="2"/>'
                    f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" '
                    f'text-anchor="middle">{_escape(label)}</text>'
                )
        lines: list[tuple[float, float, str]] = [(left, 18, self._title())]
        if columns is not None:
            lines.append((left, top - 10, self._along(columns, "columns")))
        notes = [self._caption()]
        if rows is not None:
            notes.append(self._along(rows, "rows"))
        if len(self.blocks) > 1 and self._replicated():
            notes.append(self._replicated())
        lines += [(left, top + grid_h + 20 * (i + 1), note) for i, note in enumerate(notes)]
        texts = [f'<text x="{x}" y="{y:.1f}">{_escape(text)}</text>' for x, y, text in lines]
        texts[0] = texts[0].replace("<text ", '<text font-weight="bold" ', 1)
        total_w = round(max(left + grid_w, *(x + len(t) * 7.5 for x, _, t in lines)) + 12)
        total_h = round(top + grid_h + 20 * len(notes) + 10)
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
            f'viewBox="0 0 {total_w} {total_h}" font-family="sans-serif" font-size="13" '
            f'role="img" aria-label="{_escape(self._title())}">'
            + "".join(shapes + texts)
            + "</svg>"
        )

    def _mesh_axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split dimension `dim`, major first."""
        entry = self.spec[dim] if dim < len(self.spec) else None
        if entry is None:
            return ()
        return (entry,) if isinstance(entry, str) else tuple(entry)

    def _along(self, dim: int, side: str) -> str:
        """How the picture's rows or columns cut the array: `columns: dimension 1 (64)
        split over 'model' (4)`."""
        axes = self._mesh_axes(dim)
        how = (
            "split over " + " then ".join(f"'{a}' ({self.mesh_shape[a]})" for a in axes)
            if axes
            else "not split"
        )
        return f"{side}: dimension {dim} ({self.shape[dim]}) {how}"

    def _replicated(self) -> str:
        """The mesh axes no dimension uses, over which every block is copied."""
        used = {a for d in range(len(self.shape)) for a in self._mesh_axes(d)}
        rest = [f"'{a}' ({n})" for a, n in self.mesh_shape.items() if a not in used and n > 1]
        return f"replicated over {', '.join(rest)}" if rest else ""

    def _axes_line(self) -> str:
        """The rich picture's last line: how its columns and rows cut the array."""
        rows, columns = self._axes()
        sides = [
            self._along(d, side)
            for d, side in ((columns, "columns"), (rows, "rows"))
            if d is not None
        ]
        return "; ".join(sides + ([self._replicated()] if self._replicated() else []))

    def _title(self) -> str:
        mesh = ", ".join(f"{name}={size}" for name, size in self.mesh_shape.items())
        return f"{self.path} {self.shape} {self.dtype}, {self.spec} on mesh {mesh}"

    def _caption(self) -> str:
        sizes = {tuple(b - a for a, b in block.index) for block in self.blocks}
        counts = {len(block.devices) for block in self.blocks}
        if len(self.blocks) == 1:
            devices = counts.pop()
            text = "one block" + (f", replicated on all {devices} devices" if devices > 1 else "")
        else:
            of = f" of {sizes.pop()}" if len(sizes) == 1 else ""
            on = f"each on {counts.pop()} device(s)" if len(counts) == 1 else "on devices"
            text = f"{len(self.blocks)} blocks{of}, {on}"
        return f"{text}; labels: device ids"

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=120, color_system=None, highlight=False).print(self)
        return buffer.getvalue()


_PALETTE = [
    "black on bright_cyan",
    "black on bright_green",
    "black on bright_yellow",
    "black on bright_magenta",
    "black on cyan",
    "black on green",
    "black on yellow",
    "black on magenta",
]


# Fill colours of the SVG's blocks: light, told apart, dark text readable on each.
_FILLS = ["#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#8dd3c7", "#d9d9d9"]


def _scaled(edges: list[tuple[int, int]], total: float, least: float) -> list[float]:
    """Pixel sizes of blocks with `edges`, in proportion to `total`, each at least `least`."""
    span = (edges[-1][1] - edges[0][0]) or 1
    return [max(least, total * (b - a) / span) for a, b in edges]


def _starts(origin: float, sizes: list[float]) -> list[float]:
    """Where each of blocks of `sizes`, laid end to end from `origin`, starts."""
    return [origin + sum(sizes[:i]) for i in range(len(sizes))]


def _escape(text: str) -> str:
    return html.escape(text, quote=True)


def mesh_of_devices(mesh_shape: dict[str, int]) -> Mesh:
    """A mesh of that shape over this process's devices, as `ml.make_mesh` makes it."""
    from meshlift.plans.mesh import make_mesh

    needed = math.prod(mesh_shape.values())
    if jax.device_count() >= needed:
        return make_mesh(mesh_shape)
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        cpus = []
    if len(cpus) >= needed:
        return make_mesh(mesh_shape, devices=cpus[:needed])
    raise ValueError(
        f"drawing a layout on mesh {mesh_shape} needs {needed} devices, and JAX has "
        f"{jax.device_count()}; pass ml.explain a Mesh, or on CPU set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before importing jax"
    )


def spec_entry(entry: Any) -> Any:
    """A PartitionSpec entry as JSON writes it: a tuple of axes as a list."""
    return list(entry) if isinstance(entry, tuple) else entry
