"""What is particular to the pmap backend: jax.pmap's semantics, checked against jax.pmap
itself on arrays and against ml.jit on a model's train step."""

import functools

import jax
import jax.numpy as jnp
import meshlift_pmap
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from meshlift_pmap import pmap

import meshlift as ml

N = 8  # devices (tests/conftest.py)


def test_found_by_its_entry_point_with_its_front_end():
    backend = ml.get_backend("pmap")
    assert (backend.distribution, backend.stage) == ("meshlift-pmap", meshlift_pmap.stage)
    assert ml.get_frontend("pmap") is pmap
    assert "vma-gradients" not in backend.capabilities  # pmap's gradient semantics


def scale_and_total(scale, x):
    return x * scale, jax.lax.psum(x, "i")


@pytest.mark.parametrize(
    ("in_axes", "out_axes", "shapes"),
    [
        ((None, 0), 0, ((), (N, 3))),
        ((0, 0), (0, None), ((N,), (N, 3))),
        ((None, 1), 1, ((), (3, N))),
        ((None, 1), (0, 1), ((), (2, N, 3))),
    ],
    ids=["broadcast-scale", "out-axes-none", "axis-1", "mixed-out-axes"],
)
def test_in_axes_and_out_axes_give_what_jax_pmap_gives(in_axes, out_axes, shapes):
    args = [jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) + 1 for s in shapes]
    options = dict(axis_name="i", in_axes=in_axes, out_axes=out_axes)
    ours = pmap(scale_and_total, **options)(*args)
    reference = jax.pmap(scale_and_total, **options)(*args)
    for got, want in zip(ours, reference, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want)


def test_static_broadcasted_argument_counts_in_in_axes_as_in_jax_pmap():
    def power(x, n):
        return x**n

    x = jnp.arange(float(N))
    options = dict(in_axes=(0, None), static_broadcasted_argnums=1)
    np.testing.assert_allclose(pmap(power, **options)(x, 3), jax.pmap(power, **options)(x, 3))


def test_a_mapped_axis_that_is_not_one_entry_per_device_is_jax_pmaps_value_error():
    with pytest.raises(ValueError, match=r"maps axis 0 of an argument of shape \(16, 3\) over "
                       r"8 devices, so that axis must have 8 entries"):  # fmt: skip
        pmap(lambda x: x)(jnp.ones((16, 3)))


def test_negative_in_axes_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"in_axes takes axes counted from the front"):
        pmap(lambda x: x, in_axes=-1)(jnp.ones((3, N)))


def test_donated_argument_is_consumed():
    x = pmap(lambda x: x)(jnp.ones((N, 4)))  # already one entry per device, as pmap left it
    out = pmap(lambda x: x + 1, donate_argnums=0)(x)
    assert x.is_deleted() and float(out.sum()) == 2 * N * 4


# -- a pmap-era data-parallel train step, with a Flax NNX model and optimizer --------------


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@functools.partial(pmap, axis_name="batch", in_axes=(None, None, 0, 0), out_axes=None)
def pmap_train_step(model, optimizer, x, y):
    """Written as for jax.pmap: each device's loss and gradients, averaged with pmean."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    grads = jax.lax.pmean(grads, "batch")
    optimizer.update(model, grads)
    return jax.lax.pmean(loss, "batch")


@ml.jit
def jit_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def make_state():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_pmap_era_train_step_equals_ml_jits_and_writes_back():
    x = jax.random.normal(jax.random.key(1), (N, 4, 16))  # 4 examples per device
    y = jax.random.normal(jax.random.key(2), (N, 4, 4))
    (model, optimizer), (reference, ref_optimizer) = make_state(), make_state()
    kernel = model.hidden.kernel

    losses = [float(pmap_train_step(model, optimizer, x, y)) for _ in range(3)]
    flat_x, flat_y = x.reshape(-1, 16), y.reshape(-1, 4)
    expected = [float(jit_train_step(reference, ref_optimizer, flat_x, flat_y)) for _ in range(3)]

    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert model.hidden.kernel is kernel and int(optimizer.step[...]) == 3
    for ours, theirs in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference)), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert model.hidden.kernel[...].sharding.spec == P()  # in_axes=None: replicated


def test_stacked_per_device_parameters_with_in_axes_zero():
    """in_axes=0 on a module: each device gets its own slice of every Variable, as pmap
    code with parameters stacked by device (jax.device_put_replicated) has it."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    model.kernel = nnx.Param(jnp.stack([model.kernel[...] * (d + 1) for d in range(N)]))
    model.bias = nnx.Param(jnp.zeros((N, 2)))

    @functools.partial(pmap, axis_name="d", in_axes=(0, None))
    def step(layer, x):
        layer.bias[...] += 1.0
        return layer(x)

    out = step(model, jnp.ones((1, 3)))
    assert out.shape == (N, 1, 2) and model.bias[...].shape == (N, 2)
    np.testing.assert_allclose(model.bias[...], np.ones((N, 2)))
    np.testing.assert_allclose(out[3] - 1, (out[0] - 1) * 4, rtol=1e-6)  # device 3: kernel * 4
