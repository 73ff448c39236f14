"""`meshlift/frontends.pyi` types `ml.jit`, `ml.shard_map` and `ml.pjit` without the core
importing a plugin: its signatures must be the plugins' own, overload by overload."""

import ast
import inspect
import typing
from pathlib import Path

import pytest

import meshlift as ml
import meshlift_jit
import meshlift_pjit
import meshlift_shard_map

STUB = Path(ml.__file__).with_name("frontends.pyi")
FRONTENDS = {
    "jit": meshlift_jit.jit,
    "shard_map": meshlift_shard_map.shard_map,
    "pjit": meshlift_pjit.pjit,
}


def stub_signatures(name: str) -> list[list[tuple[str, str, str, str | None]]]:
    """Each stub declaration of `name`: (parameter, kind, annotation, default) in order."""
    found = []
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            args = node.args
            kinds = [
                *(("POSITIONAL_ONLY", a) for a in args.posonlyargs),
                *(("POSITIONAL_OR_KEYWORD", a) for a in args.args),
                *(("KEYWORD_ONLY", a) for a in args.kwonlyargs),
            ]
            positional = [*args.posonlyargs, *args.args]
            given = positional[len(positional) - len(args.defaults) :]
            defaults = dict(zip(given, args.defaults, strict=True))
            keyword = zip(args.kwonlyargs, args.kw_defaults, strict=True)
            defaults |= {a: d for a, d in keyword if d is not None}
            found.append(
                [
                    (a.arg, kind, ast.unparse(a.annotation), _source(defaults.get(a)))
                    for kind, a in kinds
                ]
                + [("return", "", ast.unparse(node.returns), None)]
            )
    return found


def plugin_signatures(function) -> list[list[tuple[str, str, str, str | None]]]:
    """The same for the plugin's overloads (or the function itself, without overloads)."""
    found = []
    for declared in typing.get_overloads(function) or [function]:
        signature = inspect.signature(declared)
        found.append(
            [
                (p.name, p.kind.name, _plain(p.annotation), _default(p.default))
                for p in signature.parameters.values()
            ]
            + [("return", "", _plain(signature.return_annotation), None)]
        )
    return found


def _source(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _plain(annotation: str) -> str:
    return annotation.replace("ml.", "")  # the plugins name `ml.Lifted`, the stub `Lifted`


def _default(value) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    try:
        ast.literal_eval(repr(value))
    except (ValueError, SyntaxError):
        return "..."  # a sentinel or a call (UNSPECIFIED, frozenset()): `...` in the stub
    return repr(value)


@pytest.mark.parametrize("name", FRONTENDS)
def test_the_stub_declares_each_front_end_as_its_plugin_does(name):
    assert stub_signatures(name) == plugin_signatures(FRONTENDS[name])


def test_the_core_imports_no_plugin():
    core = Path(ml.__file__).parent
    imports = {
        alias.name if isinstance(node, ast.Import) else node.module
        for path in core.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {name for name in imports if name and name.startswith("meshlift_")}
