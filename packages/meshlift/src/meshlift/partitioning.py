"""`flax.linen.partitioning` on meshlift: T5X-era code ports by changing one import.

Code written for old `pjit` names parameters' dimensions with
`param_with_axes`, stacks layers with `scan_with_axes`, reads the names back
with `get_axis_names` and maps them to mesh axes with `axis_rules`. This
module has every public name of `flax.linen.partitioning`, with its
semantics, so that code runs under `ml.pjit` (or `ml.jit`) with one import
changed:

```py
from flax.linen import partitioning as nn_partitioning   # before
import meshlift.partitioning as nn_partitioning          # after
```

There is one rules context: `axis_rules`, `set_axis_rules` and
`get_axis_rules` here are `ml.axis_rules`' (checked when given: a malformed
rule, or one whose mesh axes repeat an axis, is refused at once), and they
share flax's store, so `ml.logical_to_mesh`, `ml.get_sharding` and flax's
own helpers all see the same rules. `logical_to_mesh_axes`, `logical_to_mesh`
and `with_sharding_constraint` are meshlift's (`ml.with_logical_constraint`:
it also finds the mesh of `ml.use_mesh` and of the deprecated `with mesh:`,
and skips a rule whose mesh axes that mesh lacks). Everything else
(`param_with_axes`, `variable_with_axes`, `get_axis_names`,
`scan_with_axes`, `vmap_with_axes`, `remat`, `AxisMetadata`, ...) is flax's
own object, re-exported: it already reads the shared rules.

Example:

```python
import flax.linen as nn
import meshlift.partitioning as nn_partitioning

class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = nn_partitioning.param_with_axes(
            "w", nn.initializers.lecun_normal(), (x.shape[-1], 32), axes=("embed", "mlp"))
        return nn_partitioning.with_sharding_constraint(x @ w, ("batch", "mlp"))

rules = (("batch", "data"), ("mlp", "model"))
with nn_partitioning.axis_rules(rules):
    variables = Dense().init(jax.random.key(0), jnp.ones((8, 16)))
    names = nn_partitioning.get_axis_names(variables["params_axes"])
    assert names == {"w": P("embed", "mlp")}
    assert ml.logical_to_mesh(names) == {"w": P(None, "model")}
```
"""

from __future__ import annotations

from flax.linen.partitioning import (
    AxisMetadata,
    PartitionedVariable,
    RulesFallback,
    ScanIn,
    ScanOut,
    core_remat_static,
    get_axis_names,
    param_with_axes,
    remat,
    scan_with_axes,
    variable_with_axes,
    vmap_with_axes,
)

from meshlift.plans.logical import (
    axis_rules,
    get_axis_rules,
    logical_to_mesh,
    logical_to_mesh_axes,
    logical_to_mesh_sharding,
    set_axis_rules,
)
from meshlift.plans.logical import with_logical_constraint as with_sharding_constraint

__all__ = [
    "AxisMetadata",
    "PartitionedVariable",
    "RulesFallback",
    "ScanIn",
    "ScanOut",
    "axis_rules",
    "core_remat_static",
    "get_axis_names",
    "get_axis_rules",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "param_with_axes",
    "remat",
    "scan_with_axes",
    "set_axis_rules",
    "variable_with_axes",
    "vmap_with_axes",
    "with_sharding_constraint",
]
