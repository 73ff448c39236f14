"""The ecosystem corpus: the libraries' own objects as test data, under every backend.

Every optax optimizer, schedule and common wrapper, every nnx layer in its
modes, `nnx.MultiMetric`, flax's `TrainState` and an orbax round trip
(`objects.CASES`), each run lifted by a backend with a plan from each of
meshlift's helpers on Auto and Explicit meshes, against `nnx.jit` running
the same code (`runner.compare`). The core's tests run every case once; the
conformance kit runs a sample on each backend; `nox -s corpus` runs them all
on every backend, plan and mesh.

Example:

```python
import jax
from meshlift.testing import corpus

mesh = jax.make_mesh((2, 4), ("data", "model"))
corpus.check("nnx.BatchNorm train", "jit", mesh, "metadata")   # raises if they differ
```
"""

from meshlift.testing.corpus.objects import CASES, Case, Job
from meshlift.testing.corpus.runner import PLANS, check, compare, run

__all__ = ["CASES", "PLANS", "Case", "Job", "check", "compare", "run"]
