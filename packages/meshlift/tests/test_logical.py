"""Logical axis rules: ordered, fallbacks, first unused mesh axis wins, never an axis twice."""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml

FALLBACK_RULES = [("embed", "data"), ("embed", "model"), ("mlp", "model")]


def test_first_unused_mesh_axis_wins_with_fallbacks():
    assert ml.logical_to_mesh(("mlp", "embed"), FALLBACK_RULES) == P("model", "data")
    assert ml.logical_to_mesh(("embed", "mlp"), FALLBACK_RULES) == P("data", "model")


def test_never_the_same_mesh_axis_twice():
    rules = [("a", "model"), ("b", "model")]
    assert ml.logical_to_mesh(P("a", "b"), rules) == P("model", None)


def test_a_name_without_a_rule_is_replicated_and_none_stays_none():
    assert ml.logical_to_mesh(("vocab", None, "mlp"), FALLBACK_RULES) == P(None, None, "model")


def test_rules_for_axes_the_mesh_lacks_are_skipped_and_said_so():
    rules = [("embed", "expert"), ("embed", "data")]
    assert ml.logical_to_mesh(("embed",), rules) == P("expert")
    with pytest.warns(ml.AxisRuleWarning, match=r"\('embed', 'expert'\) names the mesh axis"):
        assert ml.logical_to_mesh(("embed",), rules, mesh={"data": 2, "model": 4}) == P("data")


def test_tuple_mesh_axes_and_explicit_none_rule():
    rules = [("batch", ("data", "model")), ("embed", None), ("embed", "model")]
    assert ml.logical_to_mesh(("batch", "embed"), rules) == P(("data", "model"), None)


def test_trees_of_specs_and_the_context():
    specs = {"w": P("embed", "mlp"), "b": P("mlp"), "n": None}
    with ml.axis_rules(FALLBACK_RULES):
        out = ml.logical_to_mesh(specs)
    assert out == {"w": P("data", "model"), "b": P("model"), "n": None}
    assert ml.logical_to_mesh(specs["w"]) == P(None, None)  # no rules outside the block


def test_bad_rules_and_duplicate_names_say_how_to_fix():
    with pytest.raises(TypeError, match=r"\(logical_name, mesh_axes\) pairs"):
        ml.logical_to_mesh(("a",), {"a": "data"})
    with pytest.raises(ValueError, match="names two dimensions"):
        ml.logical_to_mesh(("a", "a"), [("a", "data")])


def test_logical_to_mesh_sharding():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    out = ml.logical_to_mesh_sharding({"x": P("batch", "hidden")}, mesh, [("batch", "data")])
    assert out == {"x": NamedSharding(mesh, P("data", None))}


def test_with_logical_constraint_constrains_for_real_under_use_mesh():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    rules = [("batch", "data"), ("hidden", "model")]

    def f(x):
        return ml.with_logical_constraint(x * 2, ("batch", "hidden"))

    x = jnp.ones((8, 16))
    with ml.use_mesh(mesh), ml.axis_rules(rules):
        lowered = jax.jit(f).lower(x)
        out = jax.jit(f)(x)
    assert "sharding_constraint" in lowered.as_text()
    assert out.sharding.spec == P("data", "model")
    # outside any mesh there is nothing to constrain against: unchanged, no error
    with ml.axis_rules(rules):
        assert "sharding_constraint" not in jax.jit(f).lower(x).as_text()


def test_with_logical_constraint_honours_the_deprecated_mesh_context():
    mesh = ml.make_mesh({"data": 2, "model": 4})
    x = jnp.ones((8, 16))
    f = jax.jit(lambda x: ml.with_logical_constraint(x + 1, ("batch", None), [("batch", "data")]))
    # jax warns on `with mesh:` from 0.10.1 on; before it the context is entered silently
    with_mesh_warns = jax.__version_info__ >= (0, 10, 1)
    warns = pytest.warns(DeprecationWarning) if with_mesh_warns else contextlib.nullcontext()
    with warns, mesh:
        text = f.lower(x).as_text()
    assert "sharding_constraint" in text


def test_a_rule_repeating_a_mesh_axis_says_what_to_write():
    with pytest.raises(ValueError, match=r"'x' twice.*write \('batch', \('x', 'y'\)\)"):
        ml.logical_to_mesh(("batch",), [("batch", ("x", "y", "x"))])
    rules = [("batch", ("data", "model")), ("seq", P.UNCONSTRAINED), ("embed", None)]
    with ml.axis_rules(rules) as checked:  # the block yields the rules as checked
        assert checked == tuple(rules)
        assert ml.logical_to_mesh(("seq", "batch", "embed")) == P(
            P.UNCONSTRAINED, ("data", "model"), None
        )
