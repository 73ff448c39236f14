"""The ``meshlift`` command line.

Example::

    $ meshlift backends          # installed backends, and plugins that failed to load
    $ meshlift backends --json
    $ meshlift --version
    $ meshlift demo --help
    $ meshlift plan mypkg.models:make_model --mesh data=2,model=4 [--rules rules.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    try:
        return _run(parser, args, rest)
    except BrokenPipeError:  # `meshlift backends --json | head` closed our stdout early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    if args.version:
        return _version()
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "backends":
        return _backends(as_json=args.json)
    if args.command == "plan":
        return _plan(args.target, args.mesh, args.rules, as_json=args.json)
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
    plan = commands.add_parser(
        "plan",
        help="explain a model's sharding plan on a mesh, without compiling",
        description="Print one row per parameter of the model that MODULE:FACTORY returns\n"
        "(a zero-argument callable giving an NNX module or a variable tree; it is\n"
        "evaluated abstractly, so nothing is allocated or compiled) with the spec its\n"
        "annotations give on the mesh. Exits with 1 when a spec does not fit.\n"
        "The rules file is JSON: a list of [logical_name, mesh_axis or null] pairs.",
        epilog="examples:\n  meshlift plan mymodels:make_mlp --mesh data=2,model=4\n"
        "  meshlift plan mymodels:make_mlp --mesh data=2,model=4 --rules rules.json --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:make_model")
    plan.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. data=2,model=4")
    plan.add_argument("--rules", metavar="FILE", help="JSON list of [logical, mesh_axis] pairs")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def _plan(target: str, mesh: str, rules_file: str | None, *, as_json: bool) -> int:
    import importlib
    import os
    import sys

    try:
        mesh_shape = {
            name.strip(): int(size) for name, size in (p.split("=") for p in mesh.split(","))
        }
    except ValueError:
        print(f"error: --mesh {mesh!r} is not like data=2,model=4", file=sys.stderr)
        return 2
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        print(
            f"error: {target!r} is not MODULE:FACTORY, e.g. mypkg.models:make_model",
            file=sys.stderr,
        )
        return 2
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = importlib.import_module(module_name)
        for part in factory_name.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as error:
        print(f"error: cannot load {target!r}: {error}", file=sys.stderr)
        return 2
    rules = None
    if rules_file is not None:
        with open(rules_file) as f:
            rules = [tuple(rule) for rule in json.load(f)]

    from flax import nnx

    import meshlift as ml

    tree = nnx.eval_shape(factory)  # shapes and metadata only: nothing allocated or compiled
    report = ml.explain(tree, rules, mesh_shape)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        Console(highlight=False).print(report)
    return 0 if report.ok else 1


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
