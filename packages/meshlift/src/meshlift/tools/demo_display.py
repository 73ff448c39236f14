"""What `meshlift demo` shows: a line or a progress bar per backend while it trains, then
the summary tables (results, agreement, the plan).

Example:

```python
import io
from rich.console import Console
from meshlift.tools.demo_display import Lines

out = io.StringIO()
Lines(Console(file=out, width=200)).header(["jit"], {"data": 2, "model": 4}, 3)
assert out.getvalue().startswith("meshlift demo: 3 training steps")
```
"""

from __future__ import annotations

import os
import sys
from typing import Any

import meshlift as ml
from meshlift.tools.explain import _size as _bytes  # the units of ml.explain's table


def mesh_str(axes: dict[str, int]) -> str:
    return " × ".join(f"{name}={size}" for name, size in axes.items())


class Progress:
    """What the demo shows while it trains: here, nothing (`--json`).

    `header` says what is about to run, before anything compiles; then, per backend,
    `start`, a `step` per step with its loss, and `finish` with the backend's results.
    """

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def header(self, backends: list[str], mesh: dict[str, int], steps: int) -> None:
        pass

    def start(self, backend: str, steps: int) -> None:
        pass

    def step(self, loss: float) -> None:
        pass

    def finish(self, result: dict[str, Any]) -> None:
        pass


class Lines(Progress):
    """Plain lines, each flushed at once (stdout piped or redirected): a header, then one
    line per backend as it finishes."""

    def __init__(self, console: Any) -> None:
        self.console = console

    def _print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)
        self.console.file.flush()

    def header(self, backends: list[str], mesh: dict[str, int], steps: int) -> None:
        self._print(
            f"meshlift demo: {count(steps, 'training step')} of a character-level "
            f"transformer on mesh {mesh_str(mesh)}, with each backend in turn: "
            f"{', '.join(backends)} (a backend's first step compiles the train step: seconds)"
        )

    def finish(self, result: dict[str, Any]) -> None:
        steps = len(result["losses"])
        then = f", then {result['median_step_ms']:.1f} ms a step" if steps > 1 else ""
        self._print(
            f"{result['backend']:>10}: {count(steps, 'step')}, loss {result['first_loss']:.3f}"
            f" → {result['final_loss']:.3f}, first step {result['first_step_s']:.1f} s "
            f"(compiling){then}"
        )


def count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


COMPILING = "compiling…"  # the progress bar's status until a backend's first step returns


class Bars(Lines):
    """A terminal: the header, then a live progress bar per backend. Its status reads
    "compiling…" until the backend's first step returns, then that step's loss."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bars

        super().__init__(console)
        self.bars = Bars(
            TextColumn("[bold]{task.description:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task: Any = None

    def __enter__(self) -> Progress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def start(self, backend: str, steps: int) -> None:
        self.task = self.bars.add_task(backend, total=steps, status=COMPILING)

    def step(self, loss: float) -> None:
        self.bars.update(self.task, advance=1, status=f"loss {loss:.4f}")

    def finish(self, result: dict[str, Any]) -> None:
        pass  # the bar stays, full


def make_progress(show: bool) -> Progress:
    if not show:
        return Progress()
    console = make_console()
    return Bars(console) if console.is_terminal else Lines(console)


def make_console() -> Any:
    from rich.console import Console

    # Piped (as under nox), rich assumes 80 columns, which wraps the tables: allow 120, unless
    # $COLUMNS says otherwise. Narrower, the tables fold their cells, never cut them with "…".
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    return Console(width=None if wide else 120)


def print_tables(result: dict[str, Any], explanation: ml.Explanation) -> None:
    from rich.table import Table
    from rich.text import Text

    console = make_console()
    table = Table(
        title=f"{result['steps']} steps of a character-level transformer on mesh "
        f"{mesh_str(result['mesh'])}, seed {result['seed']}"
    )
    table.add_column("backend")
    table.add_column("plan")
    table.add_column("loss (cross-entropy, nats)", justify="right")
    table.add_column(f"max |Δparameter| vs {result['reference']}", justify="right")
    table.add_column("median step", justify="right")
    table.add_column("first step (compile)", justify="right")
    table.add_column("parameter bytes/device", justify="right")
    for r in result["backends"]:
        ok = r["max_abs_diff"] <= result["tolerance"]
        table.add_row(
            r["backend"],
            r["plan"],
            f"{r['first_loss']:.3f} → {r['final_loss']:.3f}",
            f"[{'green' if ok else 'bold red'}]{r['max_abs_diff']:.1e}[/]",
            f"{r['median_step_ms']:.1f} ms",
            f"{r['first_step_s']:.1f} s",
            _bytes(r["param_bytes_per_device"]),
        )
    for column in table.columns:
        column.overflow = "fold"
    console.print(table)
    if result["agree"]:
        console.print(f"[green]{_agreement(result)}[/]")
    console.print(f"\n{_plan_intro(result)}")
    console.print(explanation)
    if result["sample"] is not None:
        sample = result["sample"]
        console.print(
            f"\nthe {sample['backend']} backend's model writes, after the prompt "
            f"{sample['prompt']!r} (greedy decoding, {len(sample['text'])} characters):"
        )
        # On one line: a newline the model wrote shows as ⏎, another control character (an
        # undertrained model writes some) as · (the JSON has the text as it is).
        shown = "".join("⏎" if c == "\n" else c if c.isprintable() else "·" for c in sample["text"])
        written = Text(shown, style="bold")
        console.print(Text(sample["prompt"], style="dim") + written)


def _agreement(result: dict[str, Any]) -> str:
    """What agreeing means for the backends that ran: one has nothing to agree with."""
    others = [r["backend"] for r in result["backends"] if r["backend"] != result["reference"]]
    if not others:
        return (
            f"{result['reference']} is the only backend that ran, so there is nothing to compare "
            f"(--backends jit,pjit,shard_map runs more)"
        )
    names = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} and {others[-1]}"
    verb = "agrees" if len(others) == 1 else "agree"
    return f"{names} {verb} with {result['reference']} to {result['tolerance']:g}"


def _plan_intro(result: dict[str, Any]) -> str:
    """The line above the plan's table: whose parameters it describes, checked."""
    backends = result["backends"]
    off = [r["backend"] for r in backends if not all(p["matches_plan"] for p in r["params"])]
    manual = [r["backend"] for r in backends if "manual-collectives" in r["capabilities"]]
    follow = (
        f"the parameters of {', '.join(off)} do NOT follow it"
        if off
        else "every backend's parameters above follow it"
    )
    if manual:
        follow += (
            f"; {', '.join(manual)} {'runs' if len(manual) == 1 else 'run'} per-shard code, "
            "manual over data only, so the compiler keeps the model split"
        )
    return f"the tensor-parallel plan ({follow}):"


def disagreement(result: dict[str, Any]) -> str:
    bad = [r for r in result["backends"] if r["max_abs_diff"] > result["tolerance"]]
    return "; ".join(
        f"{r['backend']} differs from {result['reference']} by {r['max_abs_diff']:.2e}" for r in bad
    )
