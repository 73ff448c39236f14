"""One process of the multi-process test: 4 CPU devices, a 2x4 mesh spanning 2 processes.

Run by test_multiprocess.py as
``python multiprocess_worker.py PROCESS_ID PORT BACKEND OUT.json``; writes the
losses and the final parameters (gathered from both processes) to OUT.json.
"""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from cases import MLP_CASE, STEPS  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshlift as ml  # noqa: E402


def main(process_id: int, port: int, backend_name: str, out: str) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = ml.make_mesh({"data": 2, "model": 4})
    backend = ml.get_backend(backend_name)
    manual = "manual-collectives" in backend.capabilities
    plan = MLP_CASE.manual_plan if manual else MLP_CASE.plan

    x, y = MLP_CASE.batch()  # every process builds the global batch, then keeps its rows
    rows = slice(process_id * len(x) // 2, (process_id + 1) * len(x) // 2)
    batch_sharding = NamedSharding(mesh, P("data"))
    x, y = (
        jax.make_array_from_process_local_data(batch_sharding, np.asarray(a[rows])) for a in (x, y)
    )

    model, optimizer = MLP_CASE.make(manual)
    with ml.use_mesh(mesh):
        step = ml.transform(
            backend,
            MLP_CASE.step(backend),
            mesh=mesh,
            in_specs=(plan, plan, P("data"), P("data")),
            out_specs=P(),
        )
        losses = [float(step(model, optimizer, x, y)) for _ in range(STEPS)]
    params = {
        ".".join(map(str, path)): multihost_utils.process_allgather(v[...], tiled=True).tolist()
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    specs = {
        ".".join(map(str, path)): str(v[...].sharding.spec)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    if process_id == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "params": params, "specs": specs}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
