"""dict_watch: how plain dicts tell the structure check of their changes.

CPython 3.12's dict watchers move one counter on any change to a watched
dict; on CPython 3.11 each dict's version tag (PEP 509) moves instead. Every
way of changing a dict must move one or the other, or the check would miss a
change. Where neither is available the structure check compares every
attribute, which test_graph covers on every Python.
"""

import platform
import subprocess
import sys

import flax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshlift import speedups
from meshlift.graph import dict_watch


def test_available_on_cpython_3_12_and_never_before():
    if sys.version_info < (3, 12):
        assert not dict_watch.available()
    elif platform.python_implementation() == "CPython" and sys.version_info[:2] == (3, 12):
        assert dict_watch.available()


class Block(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5)
        self.width = 2


def _replace_linear(block):
    block.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(1))


def _assign(block, i):
    block.width = i  # a store the interpreter specialises after a few runs


CHANGES = {
    "attribute": lambda b: setattr(b, "width", 3),
    "specialised attribute store": lambda b: [_assign(b, i) for i in range(10, 80)][-1],
    "object.__setattr__": lambda b: object.__setattr__(b, "width", 4),
    "new attribute": lambda b: setattr(b, "extra", 1),
    "del attribute": lambda b: delattr(b, "width"),
    "vars()[...] =": lambda b: vars(b).__setitem__("width", 5),
    "vars().update": lambda b: vars(b).update(width=6),
    "replace submodule": lambda b: setattr(b, "linear", nnx.Linear(2, 2, rngs=nnx.Rngs(1))),
    "model.eval()": lambda b: b.eval(),
    "set_metadata": lambda b: b.linear.kernel.set_metadata(tag="x"),
    "metadata copied in place": lambda b: b.linear.kernel.copy_from(
        nnx.Param(jnp.zeros((2, 2)), tag="y")
    ),
    "flax's graph update (nnx.jit)": lambda b: nnx.jit(_replace_linear)(b),
}


def test_every_change_to_a_watched_dict_moves_the_counter():
    for name, change in CHANGES.items():
        block = Block()
        metadata = object.__getattribute__(block.linear.kernel, "_var_metadata")
        dict_watch.watch([vars(block), vars(block.linear), vars(block.drop), metadata])
        before = dict_watch.changes()
        change(block)
        moved = dict_watch.changes() != before
        assert moved == dict_watch.available(), name


def test_version_tags_on_cpython_3_11_only():
    if sys.version_info[:2] == (3, 11) and platform.python_implementation() == "CPython":
        assert dict_watch.versions_available()
    else:
        assert not dict_watch.versions_available()


def dicts_of(block):
    metadata = object.__getattribute__(block.linear.kernel, "_var_metadata")
    return (vars(block), vars(block.linear), vars(block.drop), metadata)


tagged = pytest.mark.skipif(
    not dict_watch.versions_available(), reason="dict version tags are read on CPython 3.11"
)


def contents(dicts):
    return [(list(d), list(map(id, d.values()))) for d in dicts]


@tagged
def test_every_change_to_a_dict_moves_its_version_tag():
    for name, change in CHANGES.items():
        block = Block()
        dicts = dicts_of(block)
        before, held = speedups.dict_versions(dicts), contents(dicts)
        change(block)
        changed = contents(dicts) != held
        # under flax's tree mode nnx.jit makes no graph update: nothing to see
        assert changed or not flax.config.nnx_graph_mode, name
        assert not changed or speedups.dict_versions(dicts) != before, name


@tagged
def test_reading_and_calling_do_not_move_version_tags():
    block = Block()
    dicts = dicts_of(block)
    before = speedups.dict_versions(dicts)
    block.linear(jnp.ones((1, 2)))
    _ = block.width, block.linear.kernel[...]
    block.linear.kernel[...] = jnp.zeros((2, 2))
    assert speedups.dict_versions(dicts) == before


def test_reading_and_calling_do_not_move_the_counter():
    block = Block()
    dict_watch.watch([vars(block), vars(block.linear)])
    before = dict_watch.changes()
    block.linear(jnp.ones((1, 2)))
    _ = block.width, block.linear.kernel[...]
    block.linear.kernel[...] = jnp.zeros((2, 2))  # a value, not structure: lives in a slot
    assert dict_watch.changes() == before


AFTER_EXIT = """
import atexit
from flax import nnx
from meshlift.graph.split import GraphSplit

model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

def late():  # registered before meshlift's exit handler, so it runs after it
    split = GraphSplit((model,))
    assert split.unchanged()
    model.kernel = nnx.Param(model.kernel[...] * 2)
    print("detected" if not split.unchanged() else "MISSED")

atexit.register(late)
from meshlift.graph import dict_watch
dict_watch.available()  # registers the watcher and its exit handler
"""


def test_a_check_made_after_the_watcher_is_cleared_at_exit_still_sees_changes():
    out = subprocess.run(
        [sys.executable, "-c", AFTER_EXIT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "detected"
