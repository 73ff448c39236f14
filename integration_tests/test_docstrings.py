"""Docstrings are in the site's Markdown dialect, and their ```python blocks run.

Every module of the packages, the plugins and the example backend is read with `ast`
(nothing is imported to find the docstrings). Each docstring must be Markdown as
mkdocstrings renders it: no reST literal blocks (a line ending in `::`), no double
backquotes, no `:func:`-style roles. Each ```python block then runs on its own, in a
fresh namespace holding only the names every page of the docs takes as given:
`ml` (meshlift), `P` (PartitionSpec), `jax`, `jnp` and `nnx`. Fragments that cannot run
alone are fenced as ```py instead, and are not run.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import ast
import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "packages/meshlift/src",
    *sorted(ROOT.glob("plugins/*/src")),
    ROOT / "docs/examples/meshlift-remat/src",
]
MODULES = sorted(path for src in SOURCES for path in src.rglob("*.py"))
ALIASES = {"ml": ml, "P": P, "jax": jax, "jnp": jnp, "nnx": nnx}

REST = [
    (re.compile(r"::[ \t]*$", re.M), "a reST literal block (`::` at a line end)"),
    (re.compile(r"(?<!`)``(?!`)"), "double backquotes"),
    (re.compile(r":(?:func|class|mod|meth|attr|obj|data|exc):`"), "a reST role"),
]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def name_of(path: Path) -> str:
    """`meshlift/call/lift.py`: the path below its source root."""
    src = next(src for src in SOURCES if path.is_relative_to(src))
    return path.relative_to(src).as_posix()


def docstrings(path: Path) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the module and every class and function, in order."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                if (doc := ast.get_docstring(child)) is not None:
                    found.append((child.lineno, name, doc))
                visit(child, f"{name}.")

    tree = ast.parse(path.read_text(), str(path))
    if (doc := ast.get_docstring(tree)) is not None:
        found.append((0, "<module>", doc))
    visit(tree, "")
    return [(name, doc) for _, name, doc in sorted(found, key=lambda entry: entry[0])]


def examples() -> list:
    """The ```python blocks of every installed package's docstrings. The example backend is
    not installed in this session: its blocks run in `nox -s third-party`, by its own
    tests/test_docstrings.py, where it is (its Markdown is checked here all the same)."""
    params = []
    for path in MODULES:
        package = name_of(path).split("/")[0].removesuffix(".py")
        if importlib.util.find_spec(package) is None:
            continue
        for qualname, doc in docstrings(path):
            for i, code in enumerate(FENCE.findall(doc)):
                params.append(pytest.param(code, id=f"{name_of(path)}:{qualname}:{i}"))
    return params


EXAMPLES = examples()


def test_the_modules_are_found():
    names = {name_of(path) for path in MODULES}
    assert {
        "meshlift/call/lift.py",
        "meshlift_jit/__init__.py",
        "meshlift_remat/__init__.py",
    } <= names
    assert len(EXAMPLES) > 30


@pytest.mark.parametrize("path", MODULES, ids=name_of)
def test_docstrings_are_markdown(path):
    problems = [
        f"{name}: {what}: {doc[match.start() :].partition(chr(10))[0]!r}"
        for name, doc in docstrings(path)
        for pattern, what in REST
        for match in pattern.finditer(doc)
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("code", EXAMPLES)
def test_docstring_example_runs(code, request):
    namespace = {"__name__": "__docstring__", **ALIASES}
    try:
        exec(compile(code, request.node.callspec.id, "exec"), namespace)
    finally:
        ml.plugins.reset_registry()  # examples may register backends of their own
