"""make_mesh, use_mesh and current_mesh on the 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, Mesh

import meshlift as ml


def test_eight_devices_are_simulated():
    assert jax.device_count() == 8  # conftest's XLA_FLAGS; every test below relies on it


# -- make_mesh -------------------------------------------------------------------


def test_make_mesh_from_a_mapping():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    assert isinstance(mesh, Mesh)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_names == ("data", "model")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert mesh.devices.shape == (2, 4)
    assert set(mesh.devices.flat) == set(jax.devices())


def test_make_mesh_from_shape_and_names():
    mesh = ml.make_mesh((4, 2), ("data", "model"))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_names == ("data", "model")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert mesh == ml.make_mesh({"data": 4, "model": 2})


def test_make_mesh_differs_from_jax_only_in_axis_types():
    ours = ml.make_mesh({"data": 2, "model": 4})
    theirs = jax.make_mesh((2, 4), ("data", "model"))
    assert theirs.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert (ours.devices == theirs.devices).all()


def test_make_mesh_keeps_given_axis_types():
    mesh = ml.make_mesh({"data": 8}, axis_types=(AxisType.Explicit,))
    assert mesh.axis_types == (AxisType.Explicit,)


def test_make_mesh_on_given_devices():
    devices = jax.devices()[4:]
    mesh = ml.make_mesh({"x": 2, "y": 2}, devices=devices)
    assert dict(mesh.shape) == {"x": 2, "y": 2}
    assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_make_mesh_with_too_many_devices_gives_the_xla_flags_hint():
    with pytest.raises(ValueError) as info:
        ml.make_mesh({"data": 4, "model": 4})
    message = str(info.value)
    assert (
        "a mesh of shape {'data': 4, 'model': 4} needs 16 devices, but 8 are available" in message
    )
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16 before importing jax" in message


def test_make_mesh_with_the_wrong_number_of_given_devices():
    with pytest.raises(ValueError, match=r"needs 4 devices, but 2 are available"):
        ml.make_mesh({"x": 4}, devices=jax.devices()[:2])


def test_make_mesh_smaller_than_the_device_count_uses_the_first_devices():
    mesh = ml.make_mesh({"x": 4})
    assert [d.id for d in mesh.devices.flat] == [
        d.id for d in jax.make_mesh((4,), ("x",)).devices.flat
    ]


def test_make_mesh_names_given_twice():
    with pytest.raises(TypeError, match="either as the mapping's keys or as axis_names, not both"):
        ml.make_mesh({"data": 8}, ("data",))


@pytest.mark.parametrize(
    ("shape", "names", "shown"),
    [((2, 4), None, "got shape (2, 4) and names None"), ((2, 4), ("data",), "names ('data',)")],
    ids=["no names", "too few names"],
)
def test_make_mesh_needs_one_name_per_axis(shape, names, shown):
    with pytest.raises(TypeError) as info:
        ml.make_mesh(shape, names)
    assert "make_mesh needs one name per axis" in str(info.value)
    assert shown in str(info.value)
    assert "ml.make_mesh({'data': 2, 'model': 4})" in str(info.value)


# -- use_mesh and current_mesh -------------------------------------------------


def test_current_mesh_is_none_outside():
    assert ml.current_mesh() is None
    assert jax.sharding.get_abstract_mesh().empty


def test_use_mesh_sets_and_clears_the_mesh():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    with ml.use_mesh(mesh) as entered:
        assert entered is mesh
        assert ml.current_mesh() == mesh
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
        assert dict(jax.sharding.get_abstract_mesh().shape) == {"data": 2, "model": 4}
    assert ml.current_mesh() is None
    assert jax.sharding.get_abstract_mesh().empty


def test_use_mesh_clears_after_an_exception():
    mesh = ml.make_mesh({"data": 8})
    with pytest.raises(ZeroDivisionError), ml.use_mesh(mesh):
        assert ml.current_mesh() == mesh
        1 / 0  # noqa: B018
    assert ml.current_mesh() is None
    assert jax.sharding.get_abstract_mesh().empty


def test_nested_use_mesh_restores_the_outer_mesh():
    outer = ml.make_mesh({"data": 8})
    inner = ml.make_mesh({"data": 2, "model": 4})
    with ml.use_mesh(outer):
        with ml.use_mesh(inner):
            assert ml.current_mesh() == inner
        assert ml.current_mesh() == outer
        assert jax.sharding.get_abstract_mesh() == outer.abstract_mesh
    assert ml.current_mesh() is None


def test_current_mesh_sees_jax_set_mesh():
    mesh = ml.make_mesh({"data": 8})
    with jax.set_mesh(mesh):
        assert ml.current_mesh() == mesh
    assert ml.current_mesh() is None


def test_current_mesh_inside_a_trace_is_the_concrete_mesh():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    seen = []

    @jax.jit
    def f(x):
        seen.append(ml.current_mesh())
        return x + 1

    with ml.use_mesh(mesh):
        assert float(f(jnp.float32(1))) == 2.0
    (inside,) = seen
    assert inside == mesh  # the concrete mesh, so specs resolve the same inside jit/vmap/grad


def test_use_mesh_rejects_what_is_not_a_mesh():
    with (
        pytest.raises(TypeError, match=r"use_mesh takes a jax\.sharding\.Mesh, got dict"),
        ml.use_mesh({"data": 8}),
    ):
        pass
    assert ml.current_mesh() is None
