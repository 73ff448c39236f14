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
from cases import CASES, STEPS, Case, as_numpy, installed_backends, is_manual, reference
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

# (data, model) shapes; those needing more devices than there are are left out, so a
# one-GPU machine runs 1x1 only (the test ids say which meshes ran).
MESHES = [s for s in [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1)] if s[0] * s[1] <= jax.device_count()]


def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    data, model = shape
    return ml.make_mesh({"data": data, "model": model}, devices=jax.devices()[: data * model])


def params_with_paths(model: nnx.Module) -> list[tuple[str, nnx.Variable]]:
    return [(".".join(map(str, path)), v) for path, v in nnx.to_flat_state(nnx.state(model))]


def expected_xfail(case: Case, backend: ml.Backend) -> str | None:
    missing = case.requires - backend.capabilities
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
                reason = expected_xfail(case, ml.get_backend(name))
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                for shape in MESHES:
                    ids = f"{case.name}-{name}-{shape[0]}x{shape[1]}"
                    params.append(pytest.param(case, name, shape, marks=marks, id=ids))
        metafunc.parametrize(("case", "backend_name", "mesh_shape"), params)


def test_case(case, backend_name, mesh_shape):
    backend = ml.get_backend(backend_name)
    manual = is_manual(backend)
    mesh = mesh_of(mesh_shape)
    plan = case.manual_plan if manual else case.plan
    where = f"{case.name} under {backend_name} on mesh {dict(mesh.shape)}"

    model, optimizer = case.make(manual)
    x, y = case.batch()
    step = ml.transform(
        backend,
        case.step(manual),
        mesh=mesh,
        in_specs=(plan, plan, P("data"), P("data")),
        out_specs=P(),
    )
    losses = [float(step(model, optimizer, x, y)) for _ in range(STEPS)]

    ref_losses, ref_params = reference(case)
    np.testing.assert_allclose(
        losses, ref_losses, atol=case.tolerance, err_msg=f"losses of {where}"
    )
    assert int(optimizer.step[...]) == STEPS, f"{where}: optimizer updates did not land"
    for (path, variable), ref in zip(params_with_paths(model), ref_params, strict=True):
        np.testing.assert_allclose(
            as_numpy(variable[...]), ref, atol=case.tolerance, err_msg=f"`{path}` of {where}"
        )
        spec = plan.spec_for(tuple(path.split(".")), variable)
        assert variable[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), variable.ndim), (
            f"`{path}` of {where} is sharded {variable[...].sharding.spec}, the plan says {spec}"
        )


@pytest.mark.parametrize("backend_name", installed_backends())
def test_data_parallel_step_has_only_the_gradient_all_reduces(backend_name):
    """Data parallel on 8 devices: no all-gather, no collective-permute, only all-reduces."""
    backend = ml.get_backend(backend_name)
    case = next(c for c in CASES if c.data_parallel)
    manual = is_manual(backend)
    mesh = mesh_of((8, 1))
    model, optimizer = case.make(manual)
    x, y = case.batch()
    step = ml.transform(
        backend,
        case.step(manual),
        mesh=mesh,
        in_specs=(case.plan, case.plan, P("data"), P("data")),
        out_specs=P(),
    )
    text = step.lower(model, optimizer, x, y).compile().as_text()
    kinds = set(re.findall(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)\b", text))
    assert not kinds, f"unexpected collectives {kinds} in the data-parallel step of {backend_name}"
    assert "all-reduce" in text
