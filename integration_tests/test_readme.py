"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_examples():
    assert BLOCKS, f"no ```python blocks found in {README}"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code):
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)

    if "model" in namespace:  # the main example: the plan is on the arrays after a step
        model, mesh = namespace["model"], namespace["mesh"]
        assert dict(mesh.shape) == {"data": 2, "model": 4}
        assert model.linear1.kernel[...].sharding.spec == P(None, "model")
        assert model.linear2.kernel[...].sharding.spec == P("model", None)
        assert model.linear1.bias[...].sharding.is_fully_replicated
        mu = namespace["optimizer"].opt_state[0].mu
        assert mu["linear1"]["kernel"][...].sharding.spec == P(None, "model")
        assert namespace["loss"].shape == ()


def test_quick_start_commands_work_on_a_fresh_clone():
    """Each command the quick start shows needs only Python, pip and what it installed:
    the demo's own options go through nox, and the `meshlift` command is named by its path
    in the venv nox made."""
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("### On a GPU")]
    commands = [
        line.split("#")[0].strip()
        for block in re.findall(r"^```sh\n(.*?)^```", section, flags=re.S | re.M)
        for line in block.splitlines()
        if line.strip()
    ]
    assert commands
    for command in commands:
        assert command.startswith("python -m "), command  # nothing else is installed yet
    assert "python -m nox -s demo -- --steps 20" in commands
    assert "`.nox/demo/bin/meshlift demo --steps 20`" in section
    noxfile = (README.parent / "noxfile.py").read_text()
    demo_session = noxfile[noxfile.index("def demo(") :].split("\n\n\n")[0]
    assert '"meshlift", "demo", *session.posargs' in demo_session
