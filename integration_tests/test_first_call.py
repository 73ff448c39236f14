"""A first call reads one way: benchmarks/first_call.py's count of the modules it enters."""

import importlib.util
import types
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "first_call.py"
_spec = importlib.util.spec_from_file_location("first_call", SCRIPT)
first_call = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_call)


def test_a_first_call_enters_no_module_more_than_three_times():
    counts = first_call.measure()
    meshlift = counts["meshlift"]["modules"]
    assert {
        "meshlift.call.lift",
        "meshlift.call.layout",
        "meshlift.call.calls",
    } <= meshlift.keys(), meshlift
    assert max(meshlift.values()) <= 3, meshlift
    # the counter's positive control: jax's own first call enters its hub many times
    assert counts["jax.jit"]["modules"]["jax._src.pjit"] > 3


def module(name, source, **names):
    namespace = {"__name__": name, **names}
    exec(source, namespace)
    return types.SimpleNamespace(**namespace)


def test_a_hop_is_a_call_that_goes_on_into_another_module():
    c = module("lib.c", "def leaf():\n    return 1")
    b = module("lib.b", "def via():\n    return c.leaf()\ndef alone():\n    return 2", c=c)
    a = module("lib.a", "def hub():\n    return b.via() + b.alone()", b=b)
    assert first_call.hops(a.hub, ("lib.",)) == [
        ("lib.a", "lib.b", True),  # b went on into c: a hop, b entered
        ("lib.b", "lib.c", False),  # a leaf helper
        ("lib.a", "lib.b", False),  # across modules, but a leaf: no hop
    ]
