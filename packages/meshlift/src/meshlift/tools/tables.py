"""Table cells that a narrow terminal folds between words only: after `.`, `-`, `,` or a space.

rich folds a long cell at the column's edge, mid-word (`layers.0.kern` / `el`);
a `Breakable` cell wraps only after those characters, and `fit_columns` gives
every column at least its longest word, so a path piped to a file (80 columns)
stays whole on each line.

Example:

```python
from rich.console import Console
from rich.table import Table
from meshlift.tools.tables import Breakable, fit_columns

table = Table("path", "spec")
table.add_row(Breakable("layers.0.attention.query.kernel"), Breakable("P(None, 'model')"))
fit_columns(table, 30)
Console(width=30, color_system=None).print(table)   # layers.0.attention. / query.kernel
```
"""

from __future__ import annotations

import re

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

_WORD = re.compile(r"[^.\-, ]*[.\-, ]*")  # a word, and the characters a line may end after


class Breakable:
    """`text` as a table cell that wraps only after `.`, `-`, `,` or a space."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text, self.style = text, style
        self.words = [w for w in _WORD.findall(text) if w]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((len(w.rstrip()) for w in self.words), default=0)
        return Measurement(widest, len(self.text))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line = ""
        for word in self.words:
            if line and len((line + word).rstrip()) > options.max_width:
                yield Text(line.rstrip(), style=self.style, overflow="fold")
                line = ""
            line += word
        yield Text(line.rstrip(), style=self.style, overflow="fold")

    def __str__(self) -> str:
        return self.text


def fit_columns(table: Table, width: int) -> None:
    """Set each column's width so that every cell's longest word fits (a path breaks only
    between its parts), then widen the columns that need least more first, up to `width`.

    Where even the longest words do not fit, the table is left to rich, which folds.
    """
    words, full = [], []
    for column in table.columns:
        cells = [Breakable(str(c)) for c in (column.header, *column.cells)]
        words.append(max(max((len(w.rstrip()) for w in c.words), default=0) for c in cells))
        full.append(max(len(str(c)) for c in cells))
    spare = width - (len(words) + 1) - 2 * len(words) - sum(words)  # borders, padding
    if spare < 0:
        return
    widths = list(words)
    for i in sorted(range(len(words)), key=lambda i: full[i] - words[i]):
        grow = min(full[i] - words[i], spare)
        widths[i] += grow
        spare -= grow
    for column, w in zip(table.columns, widths, strict=True):
        column.width = w
