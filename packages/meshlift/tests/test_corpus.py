"""The ecosystem corpus in CI: the libraries' own objects under meshlift, against nnx.jit.

Every third case runs here, and each object of a reported defect, the
backend, plan and mesh taken in turn (jit and pjit with a plan from each of
meshlift's helpers, shard_map replicated; Auto and Explicit meshes), at the
cost of one lifted and one reference compile each. `nox -s corpus` runs
every case on every backend, plan and mesh. The corpus covers what the libraries export: the
tests at the end fail when optax or flax add an optimizer, schedule or layer
that it lacks.
"""

import functools
import inspect
import re
import warnings

import jax
import optax
import optax.schedules
import pytest
from flax import nnx
from jax.sharding import AxisType

from meshlift.testing import corpus
from meshlift.testing.corpus import objects

BACKENDS = ("jit", "pjit", "shard_map")
HELPERS = ("metadata", "get_sharding", "get_partition_spec")


@functools.cache
def mesh(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


# The objects of the defects reported from outside (issue 39): always in CI.
REPORTED = {
    "optax.adamw+cosine_decay_schedule",
    "optax.adamw+warmup_cosine_decay_schedule",
    "optax.adamw+sgdr_schedule",
    "optax.chain",
    "optax.MultiSteps",
    "optax.masked",
    "optax.multi_transform",
    "optax.apply_if_finite",
    "flax TrainState",
}


def in_turn():
    """(case, backend, plan, axis type) for every third case and each reported one, taken
    in turn: CI's budget (about a minute); `nox -s corpus` runs everything."""
    for i, name in enumerate(corpus.CASES):
        if i % 3 and name not in REPORTED:
            continue
        backend = BACKENDS[i % 3]
        plan = "replicated" if backend == "shard_map" else HELPERS[(i // 3) % 3]
        axis_type = (AxisType.Auto, AxisType.Explicit)[(i // 2) % 2]
        yield pytest.param(
            name, backend, plan, axis_type, id=f"{name}-{backend}-{plan}-{axis_type}"
        )


@pytest.mark.parametrize(("name", "backend", "plan", "axis_type"), in_turn())
def test_library_objects_run_as_under_nnx_jit(name, backend, plan, axis_type):
    corpus.check(name, backend, mesh(axis_type), plan)


# -- what the corpus covers -----------------------------------------------------------------


def test_every_optimizer_optax_exports_is_in_the_corpus():
    from optax._src import alias

    exported = {n for n, f in vars(alias).items() if inspect.isfunction(f) and n[0] != "_"}
    exported |= {n for n in dir(optax) if isinstance(getattr(optax, n), functools.partial)}
    assert exported <= set(objects.OPTIMIZERS), exported - set(objects.OPTIMIZERS)


def test_every_schedule_optax_exports_is_in_the_corpus():
    schedules = {
        name
        for name in dir(optax.schedules)
        if inspect.isfunction(getattr(optax.schedules, name)) and not name.startswith("inject")
    }
    assert schedules <= set(objects.SCHEDULES), schedules - set(objects.SCHEDULES)
    wrappers = {"inject_hyperparams", "inject_stateful_hyperparams", "MultiSteps", "chain"}
    assert wrappers | {"masked", "multi_transform", "apply_if_finite", "ema"} <= set(
        objects.WRAPPERS
    )


def test_every_nnx_layer_is_in_the_corpus_with_its_modes():
    layers = {
        name
        for name in dir(nnx)
        if isinstance(getattr(nnx, name), type) and issubclass(getattr(nnx, name), nnx.Module)
    }
    covered = {word for case in objects.LAYERS for word in re.findall(r"\w+", case)}
    assert layers - {"Module", "RNNCellBase"} <= covered, layers - covered
    for stateful in ("BatchNorm", "Dropout", "MultiHeadAttention", "SpectralNorm"):
        assert {f"{stateful} train", f"{stateful} eval"} <= set(objects.LAYERS)
    assert "MultiHeadAttention decode" in objects.LAYERS  # init_cache, then one token a call


def test_the_corpus_command_prints_a_table_of_runs(capsys):
    from meshlift.testing.corpus.__main__ import main

    with warnings.catch_warnings():
        code = main(["--backend", "jit", "--case", "TrainState", "--mesh", "auto"])
    out = capsys.readouterr().out
    assert code == 0
    assert "1 library objects against nnx.jit, on a 2x4 mesh" in out
    for plan in ("metadata", "get_sharding", "get_partition_spec"):
        assert re.search(rf"│ jit\s+│ {plan}\s+│ auto\s+│\s+1 │\s+0 │\s+0 │", out), out
