"""Every python block in docs/ runs, blocks of one page sharing a namespace, in order; a
block the page follows with "prints" and a text block prints exactly that."""

import contextlib
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

DOCS = Path(__file__).resolve().parents[1] / "docs"
# Pages of the site; the example packages under docs/examples/ are installed and tested
# by their own nox session (third-party), not here.
EXAMPLES = DOCS / "examples"
PAGES = sorted(
    p
    for p in DOCS.glob("**/*.md")
    if not p.is_relative_to(EXAMPLES) and not any(part.startswith(".") for part in p.parts)
)


BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\nprints\n\n```text\n(.*?)^```)?", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, str]]:
    """Each python block of `page` and what the page says it prints ("" if nothing)."""
    return BLOCK.findall(page.read_text())


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_runs(page):
    code = blocks(page)
    assert code, f"{page} has no python blocks to run"
    namespace: dict = {"__name__": f"__docs_{page.stem}__"}
    for i, (block, printed) in enumerate(code):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(block, f"{page}:block{i}", "exec"), namespace)
        if printed:
            assert out.getvalue() == printed, f"block {i} of {page.name} prints something else"
    _settle_runtime_tokens()


def _settle_runtime_tokens():
    """JAX re-raises a callback that failed on purpose (guide.md) at every effects
    barrier and at exit, until a computation with callbacks succeeds on those devices."""
    n = jax.device_count()
    everywhere = jax.NamedSharding(jax.make_mesh((n,), ("all",)), P("all"))
    quiet = jax.jit(lambda a: jax.debug.callback(lambda a: None, a, partitioned=True))
    quiet(jax.device_put(jnp.zeros(n), everywhere))
    jax.effects_barrier()
