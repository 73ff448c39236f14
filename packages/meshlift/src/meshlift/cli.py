"""The ``meshlift`` command line.

Example::

    $ meshlift backends          # installed backends, and plugins that failed to load
    $ meshlift backends --json
    $ meshlift --version
    $ meshlift demo --help
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version

import attrs
from rich.console import Console
from rich.table import Table

from meshlift import plugins


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and args.command != "demo":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as stop:  # --help, or a usage error argparse already printed
        return int(stop.code or 0)
    if args.version:
        return _version()
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "backends":
        return _backends(as_json=args.json)
    return _demo(rest[1:] if rest[:1] == ["--"] else rest)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshlift",
        description="Lift JAX's SPMD transforms over stateful models.",
        epilog="example: meshlift backends",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="store_true", help="show meshlift's version and each backend's"
    )
    commands = parser.add_subparsers(dest="command", title="commands")
    backends = commands.add_parser(
        "backends",
        help="list installed backends and plugins that failed to load",
        description="List the installed backends and any plugins that failed to load.\n"
        "Exits with 1 when a plugin failed to load.",
        epilog="examples:\n  meshlift backends\n  meshlift backends --json | jq '.backends[].name'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    backends.add_argument("--json", action="store_true", help="print machine-readable JSON")
    commands.add_parser(
        "demo",
        help="run the meshlift demo",
        description="Run the meshlift demo. Every argument after `demo` is passed to it;\n"
        "put `--` first to pass the demo its own --help.",
        epilog="examples:\n  meshlift demo\n  meshlift demo -- --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _backends(*, as_json: bool) -> int:
    installed = plugins.backends()
    if as_json:
        print(json.dumps({"meshlift": version("meshlift"), **attrs.asdict(installed)}, indent=2))
        return 1 if installed.errors else 0

    console = Console(markup=False, highlight=False)  # plugin text is not rich markup
    if installed.backends:
        table = Table("name", "distribution", "version", "capabilities", "description")
        for b in installed:
            table.add_row(
                b.name, b.distribution or "-", b.version, ", ".join(b.capabilities), b.description
            )
        console.print(table)
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


def _version() -> int:
    installed = plugins.backends()
    print(f"meshlift {version('meshlift')}")
    for b in installed:
        print(f"  {b.name}: {b.distribution or '-'} {b.version}")
    if installed.errors:
        print(f"  ({len(installed.errors)} plugin(s) failed to load: see `meshlift backends`)")
    return 0


def _demo(argv: list[str]) -> int:
    from meshlift import demo  # imports jax and flax: only when asked for

    return demo.main(argv)
