"""The python blocks of README.md run, top to bottom, in one namespace, and print what the
page says they print (a block followed by "prints" and a text block)."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\nprints\n\n```text\n(.*?)^```)?", re.S | re.M)


def test_readme_blocks_run_and_print_what_the_page_shows():
    blocks = BLOCK.findall(README.read_text())
    assert blocks, "README.md has no python blocks"
    assert any(printed for _, printed in blocks), "README.md shows no output"
    namespace: dict = {"__name__": "__readme__"}
    for i, (code, printed) in enumerate(blocks):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(code, f"{README}:block{i}", "exec"), namespace)
        if printed:
            assert out.getvalue() == printed, f"block {i} of README.md prints something else"
