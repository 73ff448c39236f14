"""A user's program: `nox -s lint` type-checks it with mypy, which must find nothing.

It uses each front end the way the docs do, so the types meshlift declares
(`Lifted[Params, Result]`, the decorator forms, the stages) are exercised
where users meet them.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshlift as ml


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(nnx.relu(self.linear1(x)))

    @ml.jit
    def predict(self, x: jax.Array) -> jax.Array:
        return self(x)


def train_step(model: MLP, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    def loss_fn(m: MLP) -> jax.Array:
        return jnp.mean((m(batch) - batch) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    mesh = ml.make_mesh({"data": 2, "model": 4})
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batch = jnp.ones((8, 16))

    step = ml.jit(train_step, in_shardings=(plan, plan, P("data")), mesh=mesh)
    loss: jax.Array = step(model, optimizer, batch)
    compiled = step.lower(model, optimizer, batch).compile()
    compiled(model, optimizer, batch)

    @ml.jit(static_argnums=1)
    def scale(x: jax.Array, k: int) -> jax.Array:
        return x * k

    scaled: jax.Array = scale(batch, 2)
    predicted: jax.Array = model.predict(batch)

    forward = ml.shard_map(
        train_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(), axis_names={"data"}
    )
    old = ml.pjit(train_step, in_axis_resources=(plan, plan, P("data")), out_axis_resources=None)
    lifted = ml.transform("jit", train_step, mesh=mesh, in_specs=(plan, plan, P("data")))
    with ml.use_mesh(mesh):
        old(model, optimizer, batch)
    lifted(model, optimizer, batch)
    forward(model, optimizer, batch)

    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    shardings = ml.get_sharding(nnx.state(abstract), mesh, rules=[("hidden", "model")])
    annotated = ml.StateSharding.from_metadata(abstract, [("hidden", "model")], mesh=mesh)
    explanation = ml.explain(abstract, plan, mesh)
    print(loss, scaled, predicted, shardings, annotated, explanation.to_dict())


if __name__ == "__main__":
    main()
