"""Run each page's python blocks and show what they print: the docs build's hook.

The blocks of one page run in order in one namespace, with their asserts, exactly
as `integration_tests/test_docs.py` runs them (it imports this module), so a page
shows what its code prints at build time and cannot show anything else. After a
block that prints, the page gains an output block (class `output`, labelled
"prints" by the stylesheet); a block that prints an SVG document gains the picture
itself. A block that raises stops the build, naming the page and the block.

A page may also keep the output in its source, for readers of the Markdown: a
block followed by a line "prints" and a text block. That text must be exactly
what the block prints (else `BlockError`); the page shows it the same way.

Example: the page source

    ```python
    print(2 * 21)
    ```

is rendered as that block followed by an output block holding `42`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\nprints\n\n```text\n(.*?)^```\n)?", re.S | re.M)


def blocks(markdown: str) -> list[re.Match[str]]:
    """The python blocks of a page, in order: group 1 the code, group 2 the output
    the source shows after it (None if it shows none)."""
    return list(BLOCK.finditer(markdown))


def run_page(markdown: str, name: str) -> list[str]:
    """Run the page's python blocks in one namespace; what each printed, in order.

    A block that raises makes `BlockError` naming the page and the block.
    """
    namespace: dict[str, Any] = {"__name__": f"__docs_{Path(name).stem}__"}
    printed = []
    for i, block in enumerate(blocks(markdown)):
        with contextlib.redirect_stdout(io.StringIO()) as out, _callback_log_off():
            try:
                exec(compile(block[1], f"{name}:block{i}", "exec", dont_inherit=True), namespace)
            except Exception as error:
                raise BlockError(
                    f"python block {i} of {name} raised {type(error).__name__}:\n"
                    + "".join(traceback.format_exception(error))
                ) from error
        shown = block[2]
        if shown is not None and shown != out.getvalue():
            raise BlockError(
                f"python block {i} of {name} prints something else than the page shows "
                f"after it; it prints:\n{out.getvalue()}"
            )
        printed.append(out.getvalue())
    _settle_runtime_tokens()
    return printed


class BlockError(Exception):
    """A python block of a docs page raised, or printed other than the page shows."""


def with_outputs(markdown: str, name: str) -> str:
    """The page with what each block prints shown after it."""
    pieces, end = [], 0
    for block, printed in zip(blocks(markdown), run_page(markdown, name), strict=True):
        code = f"```python\n{block[1]}```\n"
        pieces += [markdown[end : block.start()], code, _shown(printed)]
        end = block.end()
    return "".join(pieces) + markdown[end:]


def _shown(printed: str) -> str:
    if not printed.strip():
        return ""
    if printed.lstrip().startswith("<svg"):
        return f'\n<figure class="output-picture">\n{printed.strip()}\n</figure>\n'
    fence = "````" if "```" in printed else "```"
    # a table over 100 columns (the code's width) is set smaller, to fit whole; text wraps
    drawn = [line for line in printed.splitlines() if "│" in line or "┃" in line]
    wide = " .wide" if drawn and max(map(len, drawn)) > 100 else ""
    return f"\n{fence}{{.text .output{wide}}}\n{printed.rstrip()}\n{fence}\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs hook: render the page's outputs (see the module docstring)."""
    from mkdocs.exceptions import PluginError

    if page.file.src_uri.startswith("examples/"):
        return markdown  # an example package's README: its own session runs it (third-party)
    try:
        return with_outputs(markdown, page.file.src_uri)
    except BlockError as error:
        raise PluginError(str(error)) from None


@contextlib.contextmanager
def _callback_log_off() -> Iterator[None]:
    """A callback that fails on purpose (guide.md) raises on the page, and JAX logs it
    again, with its traceback, at every later barrier: keep that out of the build log."""
    log = logging.getLogger("jax._src.debugging")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


def _settle_runtime_tokens() -> None:
    """JAX re-raises a callback that failed on purpose (guide.md) at every effects
    barrier and at exit, until a computation with callbacks succeeds on those devices."""
    import sys

    if "jax" not in sys.modules:
        return
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    everywhere = jax.NamedSharding(jax.make_mesh((n,), ("all",)), P("all"))
    quiet = jax.jit(lambda a: jax.debug.callback(lambda a: None, a, partitioned=True))
    quiet(jax.device_put(jnp.zeros(n), everywhere))
    jax.effects_barrier()
