"""meshlift.call.staged_errors on its own: JAX's errors about a staged function, in the caller's
names, with a backend defined here (no plugin involved). Each case runs the same code
under `jax.jit` as its reference: the error is of JAX's type, JAX's message stands where
the plan is not at fault, and where it is, a `PlanError` names the path, JAX's error its
cause."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.call.staged_errors import axis_types_note, manual_axes_note

MESH = ml.make_mesh({"data": 2, "model": 4})
REPLICATED = P()


def stage(fn, spec):
    return jax.jit(fn, in_shardings=spec.in_specs, out_shardings=spec.out_specs)


LOCAL = ml.Backend(name="local-jit", stage=stage)


def lifted(fun, mesh=MESH, in_specs=REPLICATED, out_specs=REPLICATED):
    return ml.transform(LOCAL, fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def raised(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_an_error_of_the_function_stands_word_for_word_naming_the_backend():
    def add(x):
        return jnp.ones(3) + x  # a shape error, raised while JAX traces

    x = jnp.ones(2)
    ours, jaxs = raised(lambda: lifted(add)(x)), raised(lambda: jax.jit(add)(x))
    assert type(ours) is type(jaxs) is TypeError
    assert str(ours) == str(jaxs)
    assert "raised while backend 'local-jit' (registered in this process) ran add" in (
        ours.__notes__
    )


def test_an_output_the_out_specs_cannot_shard_is_a_plan_error_naming_it():
    def logits(x):
        return {"logits": jnp.ones(6) * x.sum()}

    x = jnp.ones((4, 4))
    ours = raised(lambda: lifted(logits, out_specs=P("model"))(x))
    reference = raised(lambda: jax.jit(logits, out_shardings=NamedSharding(MESH, P("model")))(x))
    assert isinstance(ours, ml.PlanError) and isinstance(ours, ValueError)
    assert str(ours).startswith(
        "cannot shard `output.logits` (shape (6,)) with out_specs P('model',) on mesh "
        "{'data': 2, 'model': 4}: dimension 0 (size 6) is not divisible by 4"
    )
    assert type(ours.__cause__) is type(reference)  # JAX's own error, kept as the cause

    # jax 0.12 names the output by its path in what the staged function returns (the
    # user's result is its third output) and ends with the line of the call (the two
    # calls above are on two lines)
    def words(error):
        text = str(error).replace("result[2]", "result")
        return re.sub(r" This error occurs at source: .*$", "", text, flags=re.S)

    assert words(ours.__cause__) == words(reference)


def test_sharding_in_types_on_an_auto_mesh_says_how_to_make_an_explicit_one():
    def to_data(x):
        return jax.sharding.reshard(x, P("data")) * 2

    x = jnp.ones((4, 4))
    with jax.set_mesh(MESH):
        ours, jaxs = raised(lambda: lifted(to_data)(x)), raised(lambda: jax.jit(to_data)(x))
    assert type(ours) is type(jaxs) and str(ours) == str(jaxs)
    note = (
        "meshlift: the mesh {'data': 2, 'model': 4} has Auto axes, `ml.make_mesh`'s default "
        "(`jax.make_mesh` makes Explicit ones)."
    )
    assert any(n.startswith(note) for n in ours.__notes__)
    assert "axis_types=(AxisType.Explicit,) * 2" in ours.__notes__[-1]
    explicit = ml.make_mesh({"data": 2, "model": 4}, axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):  # what the note says to do: it runs as under jax.jit
        out = lifted(to_data, mesh=explicit)(x)
        np.testing.assert_array_equal(out, jax.jit(to_data)(x))


def test_the_notes_are_given_only_where_they_apply():
    explicit = ml.make_mesh({"data": 2}, axis_types=(AxisType.Explicit,))
    assert axis_types_note(explicit, "axis name: data of type: AxisType.Auto") is None
    assert axis_types_note(MESH, "some other error") is None
    assert axis_types_note(None, "of type Auto") is None
    names = lifted(lambda x: x).names
    assert manual_axes_note(names, "an unrelated message") is None
    note = manual_axes_note(names, "Going from `Manual` AxisType to `Auto`")
    assert note is not None and "embed.embedding[...].at[ids].get(out_sharding=...)" in note


def test_a_variable_the_plan_cannot_shard_is_named_before_jax_sees_it():
    model = nnx.Module()
    model.w = nnx.Param(jnp.ones(6))
    plan = ml.StateSharding({...: P("model")})
    with pytest.raises(ml.PlanError, match=r"cannot shard `model\.w` \(shape \(6,\)\)"):
        lifted(lambda model: model.w[...] * 2, in_specs=(plan,))(model)
    assert model.w[...].shape == (6,)  # nothing written back
