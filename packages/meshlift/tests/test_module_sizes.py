"""One concept per module: no module of the core over 600 lines (the design's limit)."""

from pathlib import Path

import meshlift as ml


def test_no_module_of_the_core_is_over_600_lines():
    core = Path(ml.__file__).parent
    lines = {str(p.relative_to(core)): len(p.read_text().splitlines()) for p in core.rglob("*.py")}
    assert len(lines) > 40  # every module was read
    assert {name: n for name, n in lines.items() if n > 600} == {}
