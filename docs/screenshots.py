"""Look at the built site as a reader does: `nox -s screenshots` runs this in its venv.

    python docs/screenshots.py URL CHROMIUM OUT PAGE...

URL serves the built site; each PAGE is a path under it ("guide/", "" for the home
page). Each page is opened in CHROMIUM (Debian's, driven by Playwright) at 1280x900,
photographed whole into OUT/<page>.png and checked for

- clipped code: a code block (a printed output too) wider than its box, so that the
  reader gets a scrollbar and does not see the end of its lines at 1280 px, or a
  table drawn in a block that wraps its lines, broken apart by the wrapping;
- clipped tables: a table (markdown's, or mkdocstrings') wider than the box it scrolls
  in (mkdocs-material wraps one in a scrolling div), so that the reader gets a
  scrollbar and does not see its last columns at 1280 px; reported with its first
  header cells;
- no outputs: a guide page (not api/ or examples/) with python blocks and nothing
  shown of what they print (docs/hooks/outputs.py).

Prints a table of the pages and writes OUT/report.json: {"failures": [...]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright
from rich.console import Console
from rich.table import Table

VIEWPORT = {"width": 1280, "height": 900}

# What the checks need from a page, measured in the browser after layout. A block that
# wraps its lines (outputs, text: extra.css) never scrolls, but a table drawn in it
# (box-drawing lines) breaks apart when it wraps: those lines are measured unwrapped.
MEASURE = """() => {
  const hidden = (block) => {
    if (getComputedStyle(block).whiteSpace !== "pre-wrap") {
      return block.scrollWidth - block.clientWidth;
    }
    const drawn = block.textContent.split("\\n").filter((line) => /[\\u2500-\\u257f]/.test(line));
    const probe = block.cloneNode(false);
    probe.textContent = drawn.map((line) => line.trimEnd()).join("\\n");
    probe.style.whiteSpace = "pre";
    block.after(probe);
    const over = probe.scrollWidth - probe.clientWidth;
    probe.remove();
    return over;
  };
  // A table scrolls in its own box or in material's wrappers around it
  // (.md-typeset__table inside .md-typeset__scrollwrap): any of them narrower than what
  // it holds hides the table's last columns behind a scrollbar.
  const tableHidden = (table) => {
    const boxes = [table, table.closest(".md-typeset__table"), table.closest(".md-typeset__scrollwrap")];
    return Math.max(...boxes.filter((b) => b).map((b) => b.scrollWidth - b.clientWidth));
  };
  const header = (table) => {
    const cells = [...table.querySelectorAll("tr:first-child > th, tr:first-child > td")].slice(0, 3);
    return cells.map((c) => c.textContent.trim().replace(/\s+/g, " ")).join(" | ");
  };
  const blocks = [...document.querySelectorAll(".md-typeset pre > code")];
  const tables = [...document.querySelectorAll(".md-typeset table")];
  return {
    tables: tables.length,
    clippedTables: tables
      .map((t) => ({ header: header(t), hidden: tableHidden(t) }))
      .filter((t) => t.hidden > 0),
    code: blocks.length,
    python: document.querySelectorAll(".md-typeset div.language-python").length,
    outputs: document.querySelectorAll(".md-typeset div.output, figure.output-picture").length,
    clipped: blocks
      .map((b) => ({
        line: b.textContent.split("\\n")[0],
        hidden: hidden(b),
        wraps: getComputedStyle(b).whiteSpace === "pre-wrap",
      }))
      .filter((c) => c.hidden > 0),
  };
}"""


def check(page, url: str, name: str, shot: Path) -> tuple[dict, list[str]]:
    """Open one page, photograph it, measure it; (measures, failures)."""
    page.goto(url + name, wait_until="networkidle")
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    found = page.evaluate(MEASURE)
    where = name or "(home)"
    failures = [
        f"{where}: {'a table wraps' if c['wraps'] else 'a code block scrolls'}, "
        f"{c['hidden']} px too wide at 1280 px: {c['line'][:80]!r}"
        for c in found["clipped"]
    ]
    failures += [
        f"{where}: a table scrolls, {t['hidden']} px too wide at 1280 px: {t['header'][:80]!r}"
        for t in found["clippedTables"]
    ]
    guide = not name.startswith(("api/", "examples/"))
    found["missing"] = guide and found["python"] and not found["outputs"]
    if found["missing"]:
        failures.append(f"{where}: {found['python']} python blocks, and no output shown")
    return found, failures


def main(url: str, chromium: str, out: Path, names: list[str]) -> None:
    table = Table("page", "code blocks", "tables", "outputs", "clipped", "screenshot")
    failures = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport=VIEWPORT)
        # Only the site itself: no web fonts or scripts from elsewhere, so every run
        # (online or not) lays pages out with the same local fonts.
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(url) else r.abort())
        for name in names:
            shot = out / f"{name.strip('/').replace('/', '-') or 'index'}.png"
            found, failed = check(page, url, name, shot)
            failures += failed
            clipped = len(found["clipped"]) + len(found["clippedTables"])
            table.add_row(
                name or "(home)",
                str(found["code"]),
                str(found["tables"]),
                f"[red]{found['outputs']}" if found["missing"] else str(found["outputs"]),
                f"[red]{clipped}" if clipped else "0",
                str(shot),
            )
        browser.close()
    Console(width=160).print(table)
    (out / "report.json").write_text(json.dumps({"failures": failures}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
