"""Every python block in docs/ runs, blocks of one page sharing a namespace, in order; a
block the page follows with "prints" and a text block prints exactly that. The docs
build runs them the same way (docs/hooks/outputs.py) to show what they print."""

import importlib.util
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# Pages of the site; the example packages under docs/examples/ are installed and tested
# by their own nox session (third-party), not here.
EXAMPLES = DOCS / "examples"
PAGES = sorted(
    p
    for p in DOCS.glob("**/*.md")
    if not p.is_relative_to(EXAMPLES) and not any(part.startswith(".") for part in p.parts)
)

_spec = importlib.util.spec_from_file_location("docs_outputs", DOCS / "hooks" / "outputs.py")
outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(outputs)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_runs(page):
    markdown = page.read_text()
    assert outputs.blocks(markdown), f"{page} has no python blocks to run"
    outputs.run_page(markdown, str(page.relative_to(DOCS)))
