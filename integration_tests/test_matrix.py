"""Every case, under every installed backend, on every mesh of 8 CPU devices.

Backends come from the plugin registry, so a newly installed backend is
tested without a change here. For each (case, backend, mesh): 3 steps give the
single-device loss and parameters; every parameter's sharding is the plan's;
updates landed on the caller's objects.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from cases import CASES, MLP_CASE, STEPS, Case, as_numpy, installed_backends, is_manual, reference
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

# (data, model) shapes; those needing more devices than there are are left out, so a
# one-GPU machine runs 1x1 only (the test ids say which meshes ran).
MESHES = [s for s in [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1)] if s[0] * s[1] <= jax.device_count()]
# The two checks below are about 8-device meshes; on 8 simulated CPU devices they always run.
needs_eight_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason=f"needs 8 devices, found {jax.device_count()}"
)


def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    data, model = shape
    return ml.make_mesh({"data": data, "model": model}, devices=jax.devices()[: data * model])


def expected_xfail(case: Case, backend: ml.Backend, mesh_shape: tuple[int, int]) -> str | None:
    missing = case.requires - backend.capabilities
    if mesh_shape[0] == 1:
        missing -= {"global-rng"}  # one data shard: a per-shard draw is the global draw
    if missing:
        return f"{backend.name} lacks {sorted(missing)}, which {case.name} needs"
    if is_manual(backend) and case.manual_plan is None:
        return f"{case.name} has no per-shard step for {backend.name}"
    return None


def pytest_generate_tests(metafunc):
    if {"case", "backend_name", "mesh_shape"} <= set(metafunc.fixturenames):
        params = []
        for case in CASES:
            for name in installed_backends():
                for shape in MESHES:
                    reason = expected_xfail(case, ml.get_backend(name), shape)
                    marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                    ids = f"{case.name}-{name}-{shape[0]}x{shape[1]}"
                    params.append(pytest.param(case, name, shape, marks=marks, id=ids))
        metafunc.parametrize(("case", "backend_name", "mesh_shape"), params)


def test_case(case, backend_name, mesh_shape):
    backend = ml.get_backend(backend_name)
    manual = is_manual(backend)
    mesh = mesh_of(mesh_shape)
    plan = case.manual_plan if manual else case.plan
    where = f"{case.name} under {backend.name} on mesh {dict(mesh.shape)}"

    state = case.make(manual)
    x, y = case.batch()
    out_specs = (plan, P()) if case.linen else P()
    step = ml.transform(
        backend,
        case.step(backend),
        mesh=mesh,
        in_specs=(*[plan] * len(state), P("data"), P("data")),
        out_specs=out_specs,
    )
    losses = []
    for _ in range(STEPS):
        state, loss = case.train(step, state, x, y)
        losses.append(loss)

    ref_losses, ref_params = reference(case)
    np.testing.assert_allclose(
        losses, ref_losses, atol=case.tolerance, err_msg=f"losses of {where}"
    )
    assert case.steps_taken(state) == STEPS, f"{where}: optimizer updates did not land"
    for (path, value), ref in zip(case.params(state), ref_params, strict=True):
        name = ".".join(path)
        array = value.get_value() if isinstance(value, nnx.Variable) else value
        np.testing.assert_allclose(
            as_numpy(array), ref, atol=case.tolerance, err_msg=f"`{name}` of {where}"
        )
        spec = plan.spec_for(path, value)
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (
            f"`{name}` of {where} is sharded {array.sharding.spec}, the plan says {spec}"
        )


@needs_eight_devices
@pytest.mark.parametrize("backend_name", installed_backends())
def test_data_parallel_step_has_only_the_gradient_all_reduces(backend_name):
    """Data parallel on 8 devices: no all-gather, no collective-permute, only all-reduces."""
    backend = ml.get_backend(backend_name)
    case = next(c for c in CASES if c.data_parallel)
    manual = is_manual(backend)
    mesh = mesh_of((8, 1))
    state = case.make(manual)
    x, y = case.batch()
    step = ml.transform(
        backend,
        case.step(backend),
        mesh=mesh,
        in_specs=(case.plan, case.plan, P("data"), P("data")),
        out_specs=P(),
    )
    text = step.lower(*state, x, y).compile().as_text()
    kinds = set(re.findall(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)\b", text))
    assert not kinds, f"unexpected collectives {kinds} in the data-parallel step of {backend_name}"
    assert "all-reduce" in text


@needs_eight_devices
def test_a_backend_that_drops_the_plan_is_caught():
    """The suite's own check: a backend that replicates what the plan shards fails, by name."""

    def stage(fn, spec):
        replicated = NamedSharding(spec.mesh, P())
        var_out = tuple(replicated for _ in spec.out_specs[0])  # the plan's filters dropped
        out_specs = (var_out, *spec.out_specs[1:])
        return jax.jit(fn, in_shardings=spec.in_specs, out_shardings=out_specs)

    broken = ml.Backend(
        name="broken-jit", stage=stage, capabilities={"auto-partitioning", "global-rng"}
    )
    with pytest.raises(AssertionError) as info:
        test_case(MLP_CASE, broken, (2, 4))
    message = str(info.value)
    assert "mlp under broken-jit on mesh {'data': 2, 'model': 4}" in message
    assert "`linear1.bias`" in message and "the plan says P('model',)" in message
