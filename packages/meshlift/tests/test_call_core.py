"""The call core on its own: resolution of one call's shardings, and what the staged
function returns, with a backend defined here (no plugin involved)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.graph.split import GraphSplit
from meshlift.plans import resolve

MESH = ml.make_mesh({"data": 2, "model": 4})


def shardings_of(positional, *args):
    """`resolve.argument_shardings` for positional arguments whose graph nodes are leaves."""
    leaves = list(args)
    node_pos = tuple(i for i, a in enumerate(args) if isinstance(a, nnx.Module))
    dyn_pos = tuple(i for i in range(len(args)) if i not in node_pos)
    names = [f"arg{i}" for i in node_pos]
    split = GraphSplit(tuple(args[i] for i in node_pos), names)
    paths = [(f"arg{i}",) for i in range(len(args))]
    found = resolve.argument_shardings(
        positional, args, leaves, paths, node_pos, dyn_pos, split, MESH, "in_specs"
    )
    return split, found


def test_one_sharding_per_variable_in_split_order_and_per_other_leaf():
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    split, found = shardings_of((plan, P("data")), model, jnp.ones((4, 8)))
    specs = {path: s.spec for path, s in zip(split.paths, found.variables, strict=True)}
    assert specs == {(0, "bias"): P(), (0, "kernel"): P(None, "model")}  # node 0's
    assert found.leaves == {1: NamedSharding(MESH, P("data"))}
    assert found.by_plan == ()  # the batch's spec came from no plan


def test_a_leaf_given_a_plan_is_noted_as_resolved_by_it():
    plan = ml.StateSharding({...: P("data")})
    _, found = shardings_of((None, plan), jnp.ones(3), jnp.ones((4, 8)))
    assert found.leaves == {0: None, 1: NamedSharding(MESH, P("data"))}
    assert found.by_plan == (1,)  # its filters may read the value: checked at each trace


def test_a_shared_variable_given_two_specs_names_both_paths():
    class Pair(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.b = self.a

    plan = ml.StateSharding({nnx.PathContains("a"): P("model"), ...: P(None, "model")})
    with pytest.raises(ml.PlanError, match=r"`arg0\.a\.bias` and `arg0\.b\.bias`"):
        shardings_of((plan,), Pair())


def recording_backend(outputs: list) -> ml.Backend:
    """`jax.jit` of the pure function, keeping what each call of it returns."""

    def stage(fn, spec):
        jitted = jax.jit(fn, donate_argnums=spec.donate_argnums)

        def run(*inputs):
            out = jitted(*inputs)
            outputs.append(out)
            return out

        return run

    return ml.Backend(name="recording", stage=stage)


def test_only_the_variables_a_call_changed_are_outputs_of_its_program():
    """A forward pass returns no Variable (none is copied or written back); a train step
    returns exactly those it updated; values as under nnx.jit."""
    outputs: list = []
    backend = recording_backend(outputs)
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((3, 4))

    forward = ml.transform(backend, lambda m, x: m(x))
    for _ in range(2):  # the first call, then the fast path
        np.testing.assert_array_equal(forward(model, x), model(x))
    assert [out[0] for out in outputs] == [(None, None)] * 2

    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    twin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    reference = nnx.Optimizer(twin, optax.sgd(0.1), wrt=nnx.Param)

    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)

    ml.transform(backend, train_step)(model, optimizer, x)
    nnx.jit(train_step)(twin, reference, x)
    updated = [out is not None for out in outputs[-1][0]]
    # bias, kernel, the step count: sgd keeps no other state
    assert sum(updated) == 3 and len(updated) == 3
    np.testing.assert_allclose(model.kernel[...], twin.kernel[...], rtol=1e-6)
    assert int(optimizer.step[...]) == 1


def test_the_backend_is_named_when_its_staged_function_fails():
    def stage(fn, spec):
        def run(*inputs):
            raise RuntimeError("device lost")

        return run

    broken = ml.Backend(name="broken", stage=stage)
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    kernel = model.kernel[...]
    with pytest.raises(RuntimeError, match=re.escape("device lost")) as error:
        ml.transform(broken, lambda m: m.kernel[...])(model)
    assert "broken" in "".join(getattr(error.value, "__notes__", [])) + str(error.value)
    assert model.kernel[...] is kernel  # nothing written back


def per_device_stage(fn, spec):
    """A backend that stages as pmap does: `jax.shard_map` over one axis whose body takes
    each input's block of one entry along dimension 0 away (its own slice, as pmap's
    `in_axes=0` gives it) and puts it back on the outputs."""
    in_specs = ml.backend.shard_map_specs(spec.in_specs)
    out_specs = ml.backend.shard_map_specs(spec.out_specs)

    def body(*args):
        return jax.tree.map(lambda y: y[None], fn(*jax.tree.map(lambda x: x[0], args)))

    mapped = jax.shard_map(body, mesh=spec.mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(mapped, in_shardings=spec.in_specs, out_shardings=spec.out_specs)


PER_DEVICE = ml.Backend(name="local-per-device", stage=per_device_stage)


def test_a_backend_that_hands_each_device_its_slice_without_the_mapped_axis():
    """The check that a trace holds what its layout was made for compares per-shard values
    with the blocks of the whole arrays; a block of one entry may come without its axis
    (pmap's `in_axes=0`). Another shape still gets a new layout, and the right numbers."""
    mesh = ml.make_mesh({"d": 8})

    class Stacked(nnx.Module):
        def __init__(self, width):
            self.w = nnx.Param(jnp.arange(8.0 * width).reshape(8, width))

    def step(m, x):
        m.w[...] += x  # each device: its own row of w, of shape (width,)
        return m.w[...] * 2

    lifted = ml.transform(PER_DEVICE, step, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))
    model = Stacked(3)
    for width in (3, 3, 5, 5):  # a first call, a repeated one; then another shape, twice
        if model.w[...].shape[1] != width:
            model.w.set_value(jnp.arange(8.0 * width).reshape(8, width))  # its layout is stale
        expected = (model.w[...] + 1) * 2
        out = lifted(model, jnp.ones((8, 1)))
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(model.w[...], expected / 2)
