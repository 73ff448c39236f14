"""Running a corpus case lifted by a backend and by its reference, and comparing them.

The reference is what a flax user writes without meshlift: `nnx.jit` over
the objects (a functional `TrainState`: `jax.jit` with
`nnx.get_named_sharding` as its shardings), under `jax.set_mesh(mesh)`. Both
runs start from objects made alike and placed alike: as their metadata says,
or everything replicated for a backend that runs per shard. They are compared
on every output, every array of the final state, and the placement of each
of those arrays in the lifted run: where flax's `nnx.get_named_sharding` says
the metadata puts it (replicated, for a backend that runs per shard).

Example:

```python
import jax
from meshlift.testing.corpus.runner import compare

mesh = jax.make_mesh((2, 4), ("data", "model"))
assert compare("optax.adamw+cosine_decay_schedule", "jit", mesh, "metadata") == []
```
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.testing.corpus.objects import CASES, Job

# How the lifted run gives each stateful argument its specs: a plan from each of
# meshlift's helpers, or everything replicated (for a backend that runs per shard).
PLANS = ("metadata", "get_sharding", "get_partition_spec", "replicated")
RTOL, ATOL = 1e-5, 1e-6


@attrs.frozen
class Record:
    """What a run gave: each call's output, and every array of the final state by path."""

    outputs: tuple[Any, ...]
    arrays: dict[str, np.ndarray]
    shardings: dict[str, Any]


def specs_for(obj: Any, plan: str, mesh: Any) -> Any:
    """The specs a lifted run gives the stateful argument `obj` under `plan`."""
    if plan == "metadata":
        return ml.StateSharding.from_metadata(obj, mesh=mesh)
    if plan == "get_sharding":
        return ml.get_sharding(obj, mesh)
    if plan == "get_partition_spec":
        return ml.get_partition_spec(obj)
    return P()


def run(case: str, mesh: Any, plan: str, backend: str | ml.Backend | None = None) -> Record:
    """`case` on `mesh`, lifted by `backend` with `plan`'s specs, or by the reference
    (`backend` None) from objects placed as `plan` places them."""
    job = CASES[case].make(mesh)
    replicated = plan == "replicated"
    batch_sharding = NamedSharding(mesh, P() if replicated else P("data"))
    job.batch = tuple(jax.device_put(x, batch_sharding) for x in job.batch)
    if replicated:
        job.state = [_replicate(obj, mesh) for obj in job.state]
    with jax.set_mesh(mesh):
        call = (
            _reference(job, mesh, replicated)
            if backend is None
            else _lifted(job, mesh, plan, backend)
        )
        outputs = []
        for i in range(job.calls):
            if i and job.between is not None:
                job.state = job.between(job.state)
            out = call(*job.state, *job.batch)
            if job.returns_state:
                job.state[0], out = out
            outputs.append(jax.device_get(out))
    arrays, shardings = {}, {}
    for i, obj in enumerate(job.state):
        tree = nnx.state(obj) if graphlib.is_graph_node(obj) else obj
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = f"[{i}]{jax.tree_util.keystr(path)}"
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            arrays[name], shardings[name] = np.asarray(leaf), leaf.sharding
    return Record(tuple(outputs), arrays, shardings)


def _replicate(obj: Any, mesh: Any) -> Any:
    replicated = NamedSharding(mesh, P())
    if graphlib.is_graph_node(obj):
        nnx.update(obj, jax.device_put(nnx.state(obj), replicated))
        return obj
    return jax.device_put(obj, replicated)


def _lifted(job: Job, mesh: Any, plan: str, backend: str | ml.Backend) -> Any:
    specs = [specs_for(obj, plan, mesh) for obj in job.state]
    batch = P() if plan == "replicated" else P("data")
    out_specs = (specs[0], P()) if job.returns_state else P()
    return ml.transform(
        backend,
        job.step,
        mesh=mesh,
        in_specs=(*specs, *[batch] * len(job.batch)),
        out_specs=out_specs,
    )


def _reference(job: Job, mesh: Any, replicated: bool) -> Any:
    if not job.returns_state:
        return nnx.jit(job.step)
    state = job.state[0]
    named = NamedSharding(mesh, P()) if replicated else nnx.get_named_sharding(state, mesh)
    batch = NamedSharding(mesh, P() if replicated else P("data"))
    return jax.jit(
        job.step, in_shardings=(named, *[batch] * len(job.batch)), out_shardings=(named, None)
    )


@functools.lru_cache(maxsize=64)
def reference(case: str, mesh: Any, replicated: bool) -> Record | Exception:
    """The reference run of `case`, or what it raised (kept: every backend is compared with
    the same one). flax's own layers raise on some meshes (an RNN's carry, a lookup into
    an embedding, with the batch sharded in types on an Explicit mesh)."""
    try:
        return run(case, mesh, "replicated" if replicated else "metadata")
    except Exception as error:  # the lifted run must raise it too
        return error


def compare(case: str, backend: str | ml.Backend, mesh: Any, plan: str) -> list[str]:
    """Where `backend`'s run of `case` with `plan` differs from the reference's (empty:
    they agree): outputs, final arrays, and where each array is placed; or, where the
    reference raised, whether the lifted run raised an instance of its exception."""
    replicated = plan == "replicated"
    want = reference(case, mesh, replicated)
    if isinstance(want, Exception):
        try:
            run(case, mesh, plan, backend)
        except type(want):
            return []
        except Exception as error:
            return [f"raised {type(error).__name__} ({error}) where the reference raised {want!r}"]
        return [f"ran where the reference raised {type(want).__name__}: {want}"]
    got = run(case, mesh, plan, backend)
    problems = []
    for i, (a, b) in enumerate(zip(want.outputs, got.outputs, strict=True)):
        problems += _differences(f"call {i + 1}'s output", a, b)
    if want.arrays.keys() != got.arrays.keys():
        return [*problems, f"state paths differ: {sorted(want.arrays.keys() ^ got.arrays.keys())}"]
    for path, value in want.arrays.items():
        problems += _differences(f"`{path}`", value, got.arrays[path])
    expected = _expected_shardings(case, mesh, replicated)
    for path, sharding in got.shardings.items():
        ndim = got.arrays[path].ndim
        if path in expected and not sharding.is_equivalent_to(expected[path], ndim):
            problems.append(
                f"`{path}` is placed {sharding.spec}, where flax places it {expected[path].spec}"
            )
    return problems


def _differences(what: str, want: Any, got: Any) -> list[str]:
    want_leaves, got_leaves = jax.tree.leaves(want), jax.tree.leaves(got)
    if len(want_leaves) != len(got_leaves):
        return [f"{what}: {want} != {got}"]
    for a, b in zip(want_leaves, got_leaves, strict=True):
        try:
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=RTOL, atol=ATOL)
        except AssertionError as error:
            return [f"{what} differs: {str(error).strip().splitlines()[-3:]}"]
    return []


def _expected_shardings(case: str, mesh: Any, replicated: bool) -> dict[str, Any]:
    """Where flax's metadata puts each array of the case's state (by path)."""
    job = CASES[case].make(mesh)
    expected = {}
    for i, obj in enumerate(job.state):
        tree = nnx.state(obj) if graphlib.is_graph_node(obj) else obj
        named = nnx.get_named_sharding(tree, mesh)
        for path, sharding in jax.tree_util.tree_flatten_with_path(named)[0]:
            name = f"[{i}]{jax.tree_util.keystr(path)}"
            expected[name] = NamedSharding(mesh, P()) if replicated else sharding
    return expected


def check(case: str, backend: str | ml.Backend, mesh: Any, plan: str) -> None:
    """Raise AssertionError listing where `backend`'s run of `case` differs."""
    problems = compare(case, backend, mesh, plan)
    if problems:
        name = backend if isinstance(backend, str) else backend.name
        raise AssertionError(
            f"{case} under {name!r} with the {plan!r} plan on {dict(mesh.shape)} "
            f"({mesh.axis_types[0]} axes) differs from the reference:\n" + "\n".join(problems)
        )
