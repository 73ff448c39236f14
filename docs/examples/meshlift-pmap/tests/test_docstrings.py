"""The ```python blocks of this package's docstrings run, each on its own."""

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
BLOCKS = [
    code
    for path in sorted(SRC.rglob("*.py"))
    for node in ast.walk(ast.parse(path.read_text()))
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    for code in re.findall(r"^```python\n(.*?)^```", ast.get_docstring(node) or "", re.S | re.M)
]


def test_the_docstrings_have_examples():
    assert BLOCKS, f"no ```python blocks in the docstrings under {SRC}"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_docstring_example_runs(code):
    exec(compile(code, "docstring", "exec"), {"__name__": "__docstring__"})
