"""The `meshlift` command line.

```sh
meshlift --version           # the core and every backend distribution: version, license
meshlift backends            # installed backend plugins, from their metadata (fast)
meshlift backends --check    # import each plugin: capabilities, and plugins that fail to load
meshlift backends --json
meshlift plan mypkg.models:make_model --mesh data=2,model=4 [--rules rules.json] [--json]
meshlift plan mypkg.models:make_model --mesh data=2,model=4 --show layers.0.kernel
meshlift plan mypkg.models:make_model --mesh data=2,model=4 --why layers.0.kernel
meshlift demo --help         # the demo's own options
```

A user's mistake (a factory that needs arguments, a module that does not
import, a malformed `--mesh`, a `--show` path the model lacks) prints
`error: ...` and a `hint: ...` line to stderr and exits with status 2,
without a traceback.

jax and flax are imported only by the commands that need them (`plan`,
`demo`, and the commands that import the plugins), so `meshlift --help` and
`meshlift backends` answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.console import Console

from meshlift.tools import cli_inputs
from meshlift.tools.cli_inputs import UserError, describe

USAGE_ERROR = 2  # argparse's status for a usage error; ours for a user's mistake


def main(argv: list[str] | None = None) -> int:
    """Run the command line with `argv` (default: `sys.argv[1:]`); return the exit code."""
    parser = _parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and args.command != "demo":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as stop:  # --help, or a usage error argparse already printed
        return int(stop.code or 0)
    try:
        return _run(parser, args, rest)
    except UserError as error:
        print(f"error: {error.message}", file=sys.stderr)
        print(f"hint: {error.hint}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:  # `meshlift backends --json | head` closed our stdout early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    if args.version:
        return _version()
    if args.command is None:
        parser.print_help()
        return USAGE_ERROR
    if args.command == "backends":
        return _backends(as_json=args.json, check=args.check)
    if args.command == "plan":
        return _plan(
            args.target,
            args.mesh,
            args.rules,
            as_json=args.json,
            show=args.show or [],
            why=args.why or [],
        )
    return _demo(rest[1:] if rest[:1] == ["--"] else rest)


def _examples(*lines: tuple[str, str]) -> str:
    """An epilog: each example command, and under it what it does."""
    return "examples:\n" + "\n".join(f"  {command}\n      {what}" for command, what in lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshlift",
        description="Lift JAX's SPMD transforms over stateful models.",
        epilog=_examples(
            ("meshlift --version", "meshlift and each backend distribution: version, license"),
            ("meshlift backends", "the installed backend plugins"),
            (
                "meshlift plan mymodels:make_mlp --mesh data=2,model=4",
                "a model's sharding plan: one row per parameter",
            ),
            ("meshlift demo", "train a small transformer under every backend and compare"),
            ("meshlift plan --help", "each command's options, with examples"),
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="show the version and license of meshlift and of each backend distribution",
    )
    commands = parser.add_subparsers(dest="command", title="commands")
    backends = commands.add_parser(
        "backends",
        help="list the installed backends (--check: and plugins that fail to load)",
        description="List the installed backend plugins. Without options the list comes from\n"
        "the packages' metadata (entry points in the 'meshlift' group): nothing is\n"
        "imported. --check imports every plugin, as meshlift does on first use, and\n"
        "shows its backends' capabilities and any plugin that fails to load; it then\n"
        "exits with 1 when a plugin failed to load.",
        epilog=_examples(
            ("meshlift backends", "each plugin's name, distribution, version and summary"),
            (
                "meshlift backends --check",
                "import them: each backend's capabilities; exit 1 if a plugin fails to load",
            ),
            (
                "meshlift backends --json | jq '.backends[].name'",
                "what --check finds, as JSON: {meshlift, backends: [...], errors: [...]}",
            ),
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    backends.add_argument(
        "--check",
        action="store_true",
        help="import every plugin: capabilities, descriptions and load errors (exit 1 on one)",
    )
    backends.add_argument(
        "--json", action="store_true", help="print what --check finds as machine-readable JSON"
    )
    # The demo parses its own arguments (meshlift.tools.demo.main), --help included: every
    # argument after `demo` goes to it, so its help shows its options and an example.
    commands.add_parser(
        "demo",
        help="train a small transformer under every installed backend and compare them "
        "(meshlift demo --help for its options)",
        add_help=False,
    )
    plan = commands.add_parser(
        "plan",
        help="explain a model's sharding plan on a mesh, without compiling",
        description="Print one row per parameter of the model that MODULE:FACTORY returns\n"
        "(a zero-argument callable giving an NNX module or a variable tree; it is\n"
        "evaluated abstractly, so nothing is allocated or compiled) with the spec its\n"
        "annotations give on the mesh. Exits with 1 when a spec does not fit.\n"
        "The rules file is JSON: a list of [logical_name, mesh_axis or null] pairs.",
        epilog=_examples(
            (
                "meshlift plan mymodels:make_mlp --mesh data=2,model=4",
                "the plan of make_mlp() from mymodels.py (current folder, or installed)",
            ),
            (
                "meshlift plan mymodels:make_mlp --mesh data=2,model=4 --rules rules.json",
                'logical axis names mapped by rules.json: [["embed", null], ["mlp", "model"]]',
            ),
            (
                "meshlift plan mymodels:make_mlp --mesh data=2,model=4 --show layers.0.kernel",
                "and a picture: which devices hold which block of that parameter (repeatable)",
            ),
            (
                "meshlift plan mymodels:make_mlp --mesh data=2,model=4 --why layers.0.kernel",
                "and why that parameter has its spec: the filter, rule or annotation that "
                "decided it, and per dimension why it is split or not (repeatable)",
            ),
            (
                "meshlift plan mymodels:make_mlp --mesh data=2,model=4 --json",
                "the table as JSON (with --show: each block and its device ids too)",
            ),
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:make_model")
    plan.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. data=2,model=4")
    plan.add_argument("--rules", metavar="FILE", help="JSON list of [logical, mesh_axis] pairs")
    plan.add_argument(
        "--show",
        metavar="PATH",
        action="append",
        help="draw the device layout of the parameter at PATH, e.g. layers.0.kernel "
        "(as the table writes it; may be given more than once)",
    )
    plan.add_argument(
        "--why",
        metavar="PATH",
        action="append",
        help="say what decided the spec of the parameter at PATH and why each dimension is "
        "split or not (may be given more than once)",
    )
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


# -- plan -----------------------------------------------------------------------------------
def _plan(
    target: str,
    mesh: str,
    rules_file: str | None,
    *,
    as_json: bool,
    show: list[str],
    why: list[str],
) -> int:
    mesh_shape = cli_inputs.mesh_shape(mesh)
    rules = None if rules_file is None else cli_inputs.rules(rules_file)
    if show:
        _simulate_devices(mesh_shape)  # before the factory's module can import jax
    factory = cli_inputs.factory(target)

    from flax import nnx

    import meshlift as ml

    try:
        tree = nnx.eval_shape(factory)  # shapes and metadata only: nothing allocated or compiled
    except Exception as error:  # the user's code failed: say where, not a traceback
        raise UserError(
            f"{target}() raised {describe(error)}",
            f"meshlift plan calls it under nnx.eval_shape (abstract arrays); see the full "
            f"traceback with: python -c 'import {target.partition(':')[0]} as m; "
            f"m.{target.partition(':')[2]}()'",
        ) from None
    report = ml.explain(tree, rules, mesh_shape)
    names: list[str] = []
    if rules is None:
        report, names = _rules_needed(tree, report, mesh_shape)
    if not report.rows:
        raise UserError(
            f"{target}() returned no arrays (a {type(tree).__name__})",
            "return an NNX module (e.g. MLP(rngs=nnx.Rngs(0))) or a variable tree such as "
            "linen's model.init(...)",
        )
    layouts = [_layout(report, path) for path in show]  # every mistake before any output
    reasons = [report.why(_checked_path(report, path, "--why")) for path in why]
    if as_json:
        data = report.to_dict()
        if layouts:
            data["layouts"] = [layout.to_dict() for layout in layouts]
        if reasons:
            data["why"] = reasons
        print(json.dumps(data, indent=2))
    else:
        console = _console()
        console.print(report)
        for layout in layouts:
            console.print()
            console.print(layout)
        for reason in reasons:
            console.print()
            console.print(reason, soft_wrap=True)
    if names:
        print(f"hint: {_rules_hint(names, mesh_shape)}", file=sys.stderr)
    return 0 if report.ok else 1


def _rules_needed(tree: Any, report: Any, mesh_shape: dict[str, int]) -> tuple[Any, list[str]]:
    """The report in the command line's words where logical names have no rules, and the
    model's logical names that need them.

    `ml.explain` gives Python advice there (rules as the plan, or `ml.axis_rules`); here the
    rules come from `--rules FILE`.
    """
    import dataclasses

    from meshlift.paths import format_path
    from meshlift.plans.metadata import annotated_leaves
    from meshlift.tools.explain import needs_rules

    advice = {
        format_path(item.array_path): (needs_rules(item, mesh_shape), item.names)
        for item in annotated_leaves(tree)
        if item.kind == "logical" and item.names is not None
    }
    names: list[str] = []
    rows = []
    for row in report.rows:
        python, logical = advice.get(row.path, (None, ()))
        if python in row.problems:
            names += [n for n in logical if isinstance(n, str)]
            ours = f"it has the logical names {logical} but no --rules map them to mesh axes"
            problems = tuple(ours if p == python else p for p in row.problems)
            row = dataclasses.replace(row, problems=problems)
        rows.append(row)
    return dataclasses.replace(report, rows=tuple(rows)), list(dict.fromkeys(names))


def _rules_hint(names: list[str], mesh_shape: dict[str, int]) -> str:
    """Pass --rules FILE: an example file from the model's own logical names."""
    example = json.dumps([[name, None] for name in names])
    axes = " or ".join(mesh_shape)
    return (
        f"pass --rules FILE, a JSON list that maps the model's logical names to mesh axes, "
        f"e.g. a rules.json of {example} with a mesh axis ({axes}) in place of each null "
        f"you want sharded (null: replicated)"
    )


def _simulate_devices(mesh_shape: dict[str, int]) -> None:
    """On CPU, ask XLA for as many devices as the mesh has, unless the user chose a count.

    XLA reads the flag when JAX first creates its devices; an accelerator's own devices
    are used when there are enough of them (`Explanation.layout`).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        needed = 1
        for size in mesh_shape.values():
            needed *= size
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={needed}".strip()


def _checked_path(report: Any, path: str, option: str) -> str:
    """`path` if the report has that parameter; else a usage error naming the nearest."""
    try:
        report.row(path)
    except LookupError as error:
        raise UserError(
            f"{option} {path!r}: {error}",
            f"write a path as the table's first column shows it (meshlift plan without "
            f"{option} prints the table), e.g. {option} {report.rows[0].path}",
        ) from None
    return path


def _layout(report: Any, path: str) -> Any:
    from meshlift.errors import PlanError

    try:
        return report.layout(_checked_path(report, path, "--show"))
    except PlanError as error:
        raise UserError(
            f"--show {path!r}: {error}",
            "run meshlift plan without --show to see every problem of the plan",
        ) from None
    except ValueError as error:  # too few devices for the mesh
        raise UserError(f"--show {path!r}: {error}", "run --show in a fresh process") from None


# -- rich output ----------------------------------------------------------------------------
def _console() -> Console:
    from rich.console import Console

    # markup off: plugin and model text is not rich markup. The width is the terminal's, or
    # $COLUMNS, or 80 when piped; tables fold long cells there instead of cutting them off.
    return Console(markup=False, highlight=False)


def _print_table(
    console: Console, headers: tuple[str, ...], rows: Sequence[tuple[str, ...]]
) -> None:
    """A rich table whose cells fold onto more lines in a narrow terminal, only between words
    (after `.`, `-`, `,` or a space), never cut with "…"."""
    from rich.table import Table

    from meshlift.tools.tables import Breakable, fit_columns

    table = Table(*headers)
    for column in table.columns:
        column.overflow = "fold"
    for row in rows:
        table.add_row(*map(Breakable, row))
    fit_columns(table, console.width)
    console.print(table)


# -- backends and --version -----------------------------------------------------------------
def _backends(*, as_json: bool, check: bool) -> int:
    if not (as_json or check):
        return _listed_backends()
    import attrs

    from meshlift import plugins

    installed = plugins.backends()
    if as_json:
        print(
            json.dumps({"meshlift": _dist_version("meshlift"), **attrs.asdict(installed)}, indent=2)
        )
        return 1 if installed.errors else 0

    console = _console()
    if installed.backends:
        rows = [
            (b.name, b.distribution or "-", b.version, ", ".join(b.capabilities), b.description)
            for b in installed
        ]
        headers = ("name", "distribution", "version", "capabilities", "description")
        _print_table(console, headers, rows)
    else:
        console.print("No backends installed. Try: pip install meshlift-jit")
    if installed.errors:
        console.print(f"{len(installed.errors)} plugin(s) failed to load:", style="red")
        for error in installed.errors:
            console.print(f"  {error}")
        console.print(
            f"Set {plugins.STRICT_ENV}=1 to see the traceback,\n"
            f"or {plugins.DISABLE_ENV}=<name> to skip a plugin."
        )
        return 1
    return 0


# The names meshlift.plugins defines, without importing it (and pluggy) for a listing.
ENTRY_POINT_GROUP = "meshlift"
DISABLE_ENV = "MESHLIFT_DISABLE_PLUGINS"


def _listed_backends() -> int:
    """The plugins the installed distributions declare, read from their metadata alone.

    Nothing is imported, so neither jax nor a broken plugin can slow or stop the listing;
    `--check` imports them as `ml.backends()` does.
    """
    from importlib.metadata import entry_points

    disabled = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    rows: dict[tuple[str, str], tuple[str, str, str, str]] = {}
    skipped = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in disabled:
            skipped.append(ep.name)
            continue
        dist = ep.dist
        name = dist.name if dist is not None else "-"
        metadata: Any = dist.metadata if dist is not None else {}
        rows.setdefault(  # a distribution on sys.path twice is listed once
            (ep.name, name),
            (
                ep.name,
                name,
                dist.version if dist is not None else "-",
                metadata.get("Summary") or "",
            ),
        )
    console = _console()
    if rows:
        _print_table(
            console, ("plugin", "distribution", "version", "summary"), sorted(rows.values())
        )
        console.print(
            "Read from the packages' metadata. meshlift backends --check imports the plugins: "
            "their capabilities, and any that fails to load."
        )
    else:
        console.print("No backends installed. Try: pip install meshlift-jit")
    if skipped:
        console.print(f"Disabled by {DISABLE_ENV}: {', '.join(sorted(set(skipped)))}")
    return 0


def _version() -> int:
    """One line per distribution: the core, then each backend's, with version and license."""
    from meshlift import plugins

    installed = plugins.backends()
    provides: dict[str, list[str]] = {}  # distribution -> what it provides, in words
    for b in installed:
        provides.setdefault(b.distribution or "-", []).append(f"backend {b.name}")
    for e in installed.errors:
        provides.setdefault(e.distribution or "-", []).append(
            f"plugin {e.plugin} failed to load (see `meshlift backends --check`)"
        )
    rows = [("meshlift", _dist_version("meshlift"), _license("meshlift"), "core")]
    for dist in sorted(provides):
        rows.append(
            (
                dist,
                _dist_version(dist) if dist != "-" else "-",
                _license(dist) if dist != "-" else "-",
                ", ".join(provides[dist]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for *cells, provides_text in rows:
        aligned = (cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        print("  ".join([*aligned, provides_text]))
    return 0


def _dist_version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _license(dist: str) -> str:
    """The distribution's license: its License-Expression, else License, else a classifier."""
    import importlib.metadata

    try:
        metadata: Any = importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return "license unknown"
    for field in ("License-Expression", "License"):
        value = (metadata.get(field) or "").strip()
        if value and value.upper() != "UNKNOWN":
            return value.splitlines()[0]  # some put the whole license text in License
    classifiers = [c for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return classifiers[0].rsplit(" :: ", 1)[-1]
    return "license unknown"


# -- demo -----------------------------------------------------------------------------------
def _demo(argv: list[str]) -> int:
    from meshlift.tools import demo  # imports jax and flax: only when asked for

    try:
        return demo.main(argv)
    except SystemExit as stop:  # the demo's own --help, or a usage error it printed
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
