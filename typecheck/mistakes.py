"""The mistakes a type checker must report in meshlift code.

`nox -s lint` runs mypy over this file and checks that every line marked
`# expect: CODE` gets an error with that code, and that no other line does.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import meshlift as ml


def forward(model: nnx.Linear, batch: jax.Array) -> jax.Array:
    return model(batch)


model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
ml.jit(forward, mesh="mesh")  # expect: call-overload
step = ml.jit(forward)
step.lowr(model, jnp.ones((2, 4)))  # expect: attr-defined
ml.StateSharding.from_metadata(model, rules=42)  # expect: arg-type
text: str = step(model, jnp.ones((2, 4)))  # expect: assignment
step(model)  # expect: call-arg
