"""`meshlift/frontends.pyi` types `ml.jit`, `ml.shard_map`, `ml.pjit` and `ml.pipeline` without the core
importing a plugin: each of its overloads must take the plugin's parameters as the plugin's
signature (its lift options added by `ml.takes_lift_options`) shows them."""

import ast
import inspect
from pathlib import Path

import attrs
import pytest

import meshlift as ml
import meshlift_jit
import meshlift_pipeline
import meshlift_pjit
import meshlift_shard_map

STUB = Path(ml.__file__).with_name("frontends.pyi")
FRONTENDS = {
    "jit": meshlift_jit.jit,
    "shard_map": meshlift_shard_map.shard_map,
    "pjit": meshlift_pjit.pjit,
    "pipeline": meshlift_pipeline.pipeline,
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
            )
    return found


def plugin_signature(function) -> list[tuple[str, str, str, str | None]]:
    """The same for the plugin's front end, as `inspect.signature` (and `help()`) show it."""
    return [
        (p.name, p.kind.name, _plain(p.annotation), _default(p.default))
        for p in inspect.signature(function).parameters.values()
    ]


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
    """Equal but for the lifted function's type, which the stub's overloads narrow (a
    function, or None for a decorator), as they narrow what is returned."""
    plugin = plugin_signature(FRONTENDS[name])
    for declared in stub_signatures(name):
        assert declared[0][:2] == plugin[0][:2]  # the function's name and kind
        assert declared[1:] == plugin[1:]


def test_the_lift_options_are_each_front_ends_keywords():
    lift_options = [option.name for option in attrs.fields(ml.LiftOptions)]
    for front_end in FRONTENDS.values():
        parameters = inspect.signature(front_end).parameters
        assert set(parameters) >= set(lift_options)
        with pytest.raises(
            TypeError,
            match="unexpected keyword argument 'donate_argnum'; did you mean 'donate_argnums'",
        ):
            front_end(lambda x: x, donate_argnum=0)


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
