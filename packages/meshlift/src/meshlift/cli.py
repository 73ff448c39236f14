"""The `meshlift` command line.

```sh
meshlift --version           # the core and every backend distribution: version, license
meshlift backends            # installed backends, and plugins that failed to load
meshlift backends --json
meshlift plan mypkg.models:make_model --mesh data=2,model=4 [--rules rules.json] [--json]
meshlift demo --help         # the demo's own options
```

A user's mistake (a factory that needs arguments, a module that does not
import, a malformed `--mesh`) prints `error: ...` and a `hint: ...` line
to stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import json
import os
import sys
import traceback
from typing import Any

import attrs
from rich.console import Console
from rich.protocol import rich_cast
from rich.table import Table

from meshlift import plugins

USAGE_ERROR = 2  # argparse's status for a usage error; ours for a user's mistake


class UserError(Exception):
    """A mistake in what the user asked for: shown as `error:` and `hint:`, exit 2."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


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
        return _backends(as_json=args.json)
    if args.command == "plan":
        return _plan(args.target, args.mesh, args.rules, as_json=args.json)
    return _demo(rest[1:] if rest[:1] == ["--"] else rest)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshlift",
        description="Lift JAX's SPMD transforms over stateful models.",
        epilog="examples:\n  meshlift backends\n  meshlift --version\n"
        "  meshlift plan mymodels:make_mlp --mesh data=2,model=4\n  meshlift demo --help",
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
        help="list installed backends and plugins that failed to load",
        description="List the installed backends and any plugins that failed to load.\n"
        "Exits with 1 when a plugin failed to load.",
        epilog="examples:\n  meshlift backends\n  meshlift backends --json | jq '.backends[].name'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    backends.add_argument("--json", action="store_true", help="print machine-readable JSON")
    # The demo parses its own arguments (meshlift.demo.main), --help included: every
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
        epilog="examples:\n  meshlift plan mymodels:make_mlp --mesh data=2,model=4\n"
        "  meshlift plan mymodels:make_mlp --mesh data=2,model=4 --rules rules.json --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:make_model")
    plan.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. data=2,model=4")
    plan.add_argument("--rules", metavar="FILE", help="JSON list of [logical, mesh_axis] pairs")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


# -- plan -----------------------------------------------------------------------------------
def _plan(target: str, mesh: str, rules_file: str | None, *, as_json: bool) -> int:
    mesh_shape = _mesh_shape(mesh)
    rules = None if rules_file is None else _rules(rules_file)
    factory = _factory(target)

    from flax import nnx

    import meshlift as ml

    try:
        tree = nnx.eval_shape(factory)  # shapes and metadata only: nothing allocated or compiled
    except Exception as error:  # the user's code failed: say where, not a traceback
        raise UserError(
            f"{target}() raised {_describe(error)}",
            f"meshlift plan calls it under nnx.eval_shape (abstract arrays); see the full "
            f"traceback with: python -c 'import {target.partition(':')[0]} as m; "
            f"m.{target.partition(':')[2]}()'",
        ) from None
    report = ml.explain(tree, rules, mesh_shape)
    if not report.rows:
        raise UserError(
            f"{target}() returned no arrays (a {type(tree).__name__})",
            "return an NNX module (e.g. MLP(rngs=nnx.Rngs(0))) or a variable tree such as "
            "linen's model.init(...)",
        )
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _console().print(_fold(report))
    return 0 if report.ok else 1


def _mesh_shape(text: str) -> dict[str, int]:
    hint = "give each mesh axis a name and a size, e.g. --mesh data=2,model=4"
    shape: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not name or not size:
            raise UserError(f"--mesh {text!r}: {part.strip()!r} is not NAME=SIZE", hint)
        if not size.isdigit() or int(size) < 1:
            raise UserError(
                f"--mesh {text!r}: the size of {name!r} is not a positive integer", hint
            )
        if name in shape:
            raise UserError(f"--mesh {text!r}: the axis {name!r} is given twice", hint)
        shape[name] = int(size)
    return shape


def _rules(path: str) -> list[tuple[Any, ...]]:
    hint = (
        "the rules file is a JSON list of [logical_name, mesh_axis or null] pairs, "
        'e.g. [["batch", "data"], ["hidden", "model"], ["embed", null]]'
    )
    try:
        with open(path) as f:
            rules = json.load(f)
    except OSError as error:
        raise UserError(f"--rules {path!r}: {error.strerror}", hint) from None
    except json.JSONDecodeError as error:
        raise UserError(f"--rules {path!r} is not JSON: {error}", hint) from None
    if not isinstance(rules, list):
        raise UserError(f"--rules {path!r} holds a {type(rules).__name__}, not a list", hint)
    for rule in rules:
        if not _is_rule(rule):
            raise UserError(f"--rules {path!r}: {json.dumps(rule)} is not such a pair", hint)
    return [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules]


def _is_rule(rule: Any) -> bool:
    """`[logical_name, mesh_axis]`, the mesh axis a name, a list of names, or null."""
    if not (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)):
        return False
    axes = rule[1]
    return (
        axes is None
        or isinstance(axes, str)
        or (isinstance(axes, list) and all(isinstance(a, str) for a in axes))
    )


def _factory(target: str) -> Any:
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise UserError(
            f"{target!r} is not MODULE:FACTORY",
            "name a module and a zero-argument callable in it, e.g. mypkg.models:make_model",
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):
            raise UserError(
                f"no module named {error.name!r}",
                f"run meshlift from the folder that holds {module_name.replace('.', '/')}.py "
                f"(the current folder, {os.getcwd()}, is searched), or install its package",
            ) from None
        raise UserError(
            f"importing {module_name!r} failed: {_describe(error)}",
            f"install what it imports, or see the traceback with: python -c 'import {module_name}'",
        ) from None
    except Exception as error:  # a SyntaxError, or anything the module raises as it runs
        raise UserError(
            f"importing {module_name!r} failed: {_describe(error)}",
            f"see the traceback with: python -c 'import {module_name}'",
        ) from None
    factory: Any = module
    for i, part in enumerate(factory_name.split(".")):
        if not hasattr(factory, part):
            where = ".".join([module_name, *factory_name.split(".")[:i]])
            names = (
                [n for n, v in vars(factory).items() if callable(v) and not n.startswith("_")]
                if hasattr(factory, "__dict__")
                else []
            )
            raise UserError(
                f"{where!r} has no attribute {part!r}",
                f"it has: {', '.join(names[:12])}" if names else "check the spelling",
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise UserError(
            f"{target} is not callable: it is the {type(factory).__name__} {factory!r:.40}",
            "name a zero-argument function or class that returns the model",
        )
    _check_no_arguments(target, factory)
    return factory


def _check_no_arguments(target: str, factory: Any) -> None:
    try:
        # A class's own __init__: NNX's metaclass hides it behind (*args, **kwargs).
        signature = inspect.signature(factory.__init__ if isinstance(factory, type) else factory)
    except (TypeError, ValueError):  # no signature to read (some builtins): just call it
        return
    parameters = list(signature.parameters.values())[isinstance(factory, type) :]  # no self
    required = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        module_name, _, factory_name = target.partition(":")
        call = ", ".join(f"{n}=..." if n != "rngs" else "rngs=nnx.Rngs(0)" for n in required)
        raise UserError(
            f"{target} needs arguments ({', '.join(required)}), and meshlift plan calls it "
            f"with none",
            f"name a zero-argument factory, e.g. in {module_name.replace('.', '/')}.py: "
            f"def make_model(): return {factory_name}({call}); then "
            f"meshlift plan {module_name}:make_model",
        )


def _describe(error: BaseException) -> str:
    """`Type: first line of the message (at file:line)`, the line in the user's code."""
    if isinstance(error, SyntaxError):
        message, where = error.msg, f" (at {error.filename}:{error.lineno})"
    else:
        message = str(error).splitlines()[0] if str(error) else ""
        # The innermost frame outside the installed libraries and meshlift: the user's line.
        mine = os.path.dirname(__file__)
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if "site-packages" not in f.filename and not f.filename.startswith(mine)
        ]
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}{': ' + message if message else ''}{where}"


# -- rich output ----------------------------------------------------------------------------
def _console() -> Console:
    # markup off: plugin and model text is not rich markup. The width is the terminal's, or
    # $COLUMNS, or 80 when piped; tables fold long cells there instead of cutting them off.
    return Console(markup=False, highlight=False)


def _fold(renderable: Any) -> Any:
    """`renderable` with every table's cells folded onto more lines, never cut with "…"."""
    renderable = rich_cast(renderable)
    for table in [renderable, *getattr(renderable, "renderables", [])]:
        if isinstance(table, Table):
            for column in table.columns:
                column.overflow = "fold"
    return renderable


# -- backends and --version -----------------------------------------------------------------
def _backends(*, as_json: bool) -> int:
    installed = plugins.backends()
    if as_json:
        print(
            json.dumps({"meshlift": _dist_version("meshlift"), **attrs.asdict(installed)}, indent=2)
        )
        return 1 if installed.errors else 0

    console = _console()
    if installed.backends:
        table = Table("name", "distribution", "version", "capabilities", "description")
        for b in installed:
            table.add_row(
                b.name, b.distribution or "-", b.version, ", ".join(b.capabilities), b.description
            )
        console.print(_fold(table))
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
    """One line per distribution: the core, then each backend's, with version and license."""
    installed = plugins.backends()
    provides: dict[str, list[str]] = {}  # distribution -> what it provides, in words
    for b in installed:
        provides.setdefault(b.distribution or "-", []).append(f"backend {b.name}")
    for e in installed.errors:
        provides.setdefault(e.distribution or "-", []).append(
            f"plugin {e.plugin} failed to load (see `meshlift backends`)"
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
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _license(dist: str) -> str:
    """The distribution's license: its License-Expression, else License, else a classifier."""
    try:
        metadata = importlib.metadata.metadata(dist)
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
    from meshlift import demo  # imports jax and flax: only when asked for

    try:
        return demo.main(argv)
    except SystemExit as stop:  # the demo's own --help, or a usage error it printed
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
