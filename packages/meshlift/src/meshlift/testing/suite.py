"""The conformance suite: what every meshlift backend must do, on a 2x4 mesh of 8 devices.

Each test takes the `meshlift_backend` fixture of the `meshlift.testing`
plugin, so it runs once per selected backend. Tests call the backend the way
users do, through `ml.transform(backend, fn, mesh=..., in_specs=...,
out_specs=...)`, and compare against an eager single-device run of the same
tiny model. A backend with the `manual-collectives` capability gets the
per-shard form of each function (see `meshlift.testing.models`).

Run it from a backend's tests (`from meshlift.testing import TestConformance`
in a test module that opts in to the plugin), or against everything installed:

```sh
pytest -p meshlift.testing --pyargs meshlift.testing.suite
```
"""

from __future__ import annotations

import gc
import weakref
from importlib.metadata import PackageNotFoundError, distribution

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshlift as ml
from meshlift.testing import corpus, oracle
from meshlift.testing import models as M
from meshlift.testing.capabilities import requires
from meshlift.testing.traits import ArgumentTraits

SCALAR = P()
# A sample of the ecosystem corpus each backend runs: a schedule that changes itself in
# place, written-back statistics, a decoding cache, a flax TrainState.
LIBRARY_OBJECTS = (
    "optax.adamw+cosine_decay_schedule",
    "nnx.BatchNorm train",
    "nnx.MultiHeadAttention decode",
    "flax TrainState",
)


def lift(backend: ml.Backend, fn, mesh, in_specs, out_specs=SCALAR, **kwargs):
    return ml.transform(backend, fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)


def claims(backend: ml.Backend) -> str:
    """`'name', which claims donation, stages`: how the gradient tests name the backend, so
    a failure shows the capabilities the kit chose its step by."""
    claimed = ", ".join(sorted(backend.capabilities)) or "no capabilities"
    return f"{backend.name!r}, which claims {claimed}"


def assert_placed(node, plan: ml.StateSharding, mesh, where: str) -> None:
    wrong = M.misplaced(node, plan, mesh)
    assert not wrong, f"{where}: placed otherwise than the plan says (path, actual, plan): {wrong}"


def assert_arrays_equal(node, expected: dict, where: str, prefix: str | None = None) -> None:
    actual = M.flat_arrays(node, prefix)
    assert actual.keys() == expected.keys(), where
    for path, value in actual.items():
        np.testing.assert_allclose(
            value, expected[path], atol=M.TOLERANCE, err_msg=f"`{'.'.join(path)}` {where}"
        )


class TestConformance(ArgumentTraits):
    """The conformance suite, one test per property; parametrized over `meshlift_backend`."""

    # -- the backend object -------------------------------------------------------------------
    def test_backend_describes_itself(self, meshlift_backend):
        backend = meshlift_backend
        assert isinstance(backend, ml.Backend)
        assert isinstance(backend.name, str) and backend.name, "a backend needs a name"
        assert callable(backend.stage), "Backend.stage(fn, spec) stages a pure function"
        assert isinstance(backend.version, str)
        assert all(isinstance(c, str) for c in backend.capabilities)
        installed = {info.name: info for info in ml.backends()}
        if installed.get(backend.name) is None or ml.get_backend(backend.name) is not backend:
            return  # an unpublished backend, passed as an object: nothing to look up
        info = installed[backend.name]
        assert info.distribution, f"{backend.name} is registered without its distribution"
        try:
            published = distribution(info.distribution).version
        except PackageNotFoundError:
            pytest.fail(f"{backend.name} names distribution {info.distribution!r}, not installed")
        assert info.version == published, "Backend.version should be its distribution's version"
        broken = [e for e in ml.backends().errors if e.distribution == info.distribution]
        assert not broken, f"plugins of {info.distribution} failed to load: {broken}"

    # -- split and merge ----------------------------------------------------------------------
    def test_pytree_of_arrays_round_trips_and_takes_the_plans_shardings(
        self, meshlift_backend, meshlift_mesh
    ):
        params = {"dense": {"kernel": jnp.ones((M.WIDTH, M.HIDDEN)), "bias": jnp.arange(M.HIDDEN)}}
        plan = ml.StateSharding(
            {ml.path_endswith("kernel"): P(None, "model"), ml.path_endswith("bias"): P("model")}
        )
        out = lift(meshlift_backend, lambda p: p, meshlift_mesh, (plan,), plan)(params)
        assert jax.tree.structure(out) == jax.tree.structure(params)
        for path, spec in (
            (("dense", "kernel"), P(None, "model")),
            (("dense", "bias"), P("model")),
        ):
            array = out[path[0]][path[1]]
            np.testing.assert_array_equal(array, params[path[0]][path[1]])
            assert array.sharding.is_equivalent_to(NamedSharding(meshlift_mesh, spec), array.ndim)

    def test_graph_arguments_returned_are_the_callers_objects(
        self, meshlift_backend, meshlift_mesh
    ):
        model, optimizer = M.make_mlp()
        before = M.flat_arrays(model)
        plan = M.TENSOR_PARALLEL
        out = lift(
            meshlift_backend, lambda m, o: (m, o), meshlift_mesh, (plan, plan), (plan, plan)
        )(model, optimizer)
        assert out[0] is model and out[1] is optimizer
        assert_arrays_equal(model, before, "after an identity call")
        assert_placed(model, plan, meshlift_mesh, "model after an identity call")

    def test_module_made_inside_comes_out_whole_and_placed_by_the_plan(
        self, meshlift_backend, meshlift_mesh, meshlift_per_shard
    ):
        # Per shard, a module made inside is whole on each shard: it can only be replicated.
        plan = M.REPLICATED if meshlift_per_shard else M.TENSOR_PARALLEL
        model = lift(meshlift_backend, lambda: M.MLP(nnx.Rngs(0)), meshlift_mesh, (), plan)()
        assert isinstance(model, M.MLP)
        assert_arrays_equal(model, M.flat_arrays(M.MLP(nnx.Rngs(0))), "made inside")
        assert_placed(model, plan, meshlift_mesh, "module made inside")

    # -- write-back -----------------------------------------------------------------------------
    def test_train_step_writes_back_parameters_and_optimizer_state(
        self, meshlift_backend, meshlift_mesh, meshlift_train_step
    ):
        model, optimizer = M.make_mlp()
        kernel = model.linear1.kernel
        plan = M.TENSOR_PARALLEL
        x, y = M.batch()
        step = lift(
            meshlift_backend,
            meshlift_train_step,
            meshlift_mesh,
            (plan, plan, P("data"), P("data")),
        )
        losses = [float(step(model, optimizer, x, y)) for _ in range(M.STEPS)]
        ref_losses, ref_arrays = M.reference_training()
        where = f"after {M.STEPS} steps under {claims(meshlift_backend)}"
        np.testing.assert_allclose(losses, ref_losses, atol=M.TOLERANCE, err_msg=f"losses {where}")
        assert model.linear1.kernel is kernel, "write-back must update Variables in place"
        assert int(optimizer.step[...]) == M.STEPS, f"optimizer step count {where}"
        expected = {p: v for p, v in ref_arrays.items() if p[0] != "optimizer"}
        assert_arrays_equal(model, expected, where)
        expected = {p: v for p, v in ref_arrays.items() if p[0] == "optimizer"}
        assert_arrays_equal(optimizer, expected, where, prefix="optimizer")

    def test_parameters_and_optimizer_state_are_sharded_as_the_plan_says(
        self, meshlift_backend, meshlift_mesh, meshlift_per_shard, meshlift_train_step
    ):
        model, optimizer = M.make_mlp()
        plan = M.TENSOR_PARALLEL
        x, y = M.batch()
        forward = lift(
            meshlift_backend,
            lambda m, x: M.forward(m, x, per_shard=meshlift_per_shard),
            meshlift_mesh,
            (plan, P("data")),
            P("data"),
        )
        out = forward(model, x)  # writes nothing: the arguments are still placed once
        assert out.sharding.is_equivalent_to(NamedSharding(meshlift_mesh, P("data")), 2)
        np.testing.assert_allclose(out, M.forward(M.make_mlp()[0], x), atol=M.TOLERANCE)
        assert_placed(model, plan, meshlift_mesh, "model after a forward call")
        step = lift(
            meshlift_backend,
            meshlift_train_step,
            meshlift_mesh,
            (plan, plan, P("data"), P("data")),
        )
        step(model, optimizer, x, y)
        assert_placed(model, plan, meshlift_mesh, "model after a train step")
        assert_placed(optimizer, plan, meshlift_mesh, "optimizer state after a train step")

    def test_batchnorm_statistics_are_written_back(
        self, meshlift_backend, meshlift_mesh, meshlift_per_shard
    ):
        bn, reference = M.make_batchnorm(meshlift_per_shard), M.make_batchnorm(False)
        x = jax.random.normal(jax.random.key(3), (M.BATCH, M.WIDTH)) * 3 + 1
        plan = M.STATS_PLAN
        spec = P("data", "model")
        call = lift(meshlift_backend, lambda bn, x: bn(x), meshlift_mesh, (plan, spec), spec)
        for i in range(2):
            np.testing.assert_allclose(
                call(bn, x), reference(x), atol=M.TOLERANCE, err_msg=f"BatchNorm output, call {i}"
            )
        for name in ("mean", "var"):
            np.testing.assert_allclose(
                getattr(bn, name)[...], getattr(reference, name)[...], atol=M.TOLERANCE,
                err_msg=f"BatchNorm running {name} after 2 calls",
            )  # fmt: skip
        assert_placed(bn, plan, meshlift_mesh, "BatchNorm after 2 calls")

    def test_rng_counters_are_written_back(self, meshlift_backend, meshlift_mesh):
        dropout = M.make_dropout()
        key = np.asarray(jax.random.key_data(dropout.rngs.key[...]))
        x = jnp.ones((M.BATCH, M.WIDTH))
        call = lift(
            meshlift_backend, lambda d, x: d(x), meshlift_mesh, (M.REPLICATED, P("data")), P("data")
        )
        first, second = np.asarray(call(dropout, x)), np.asarray(call(dropout, x))
        assert int(dropout.rngs.count[...]) == 2, "each call draws once: count 0 -> 2"
        np.testing.assert_array_equal(jax.random.key_data(dropout.rngs.key[...]), key)
        assert not np.array_equal(first, second), "the second call reused the first call's draw"

    @requires("global-rng")
    def test_random_draws_match_an_unsharded_run(self, meshlift_backend, meshlift_mesh):
        dropout, reference = M.make_dropout(), M.make_dropout()
        x = jnp.ones((M.BATCH, M.WIDTH))
        call = lift(
            meshlift_backend, lambda d, x: d(x), meshlift_mesh, (M.REPLICATED, P("data")), P("data")
        )
        for i in range(2):
            np.testing.assert_array_equal(call(dropout, x), reference(x), err_msg=f"call {i}")

    def test_exception_inside_leaves_the_callers_objects_unchanged(
        self, meshlift_backend, meshlift_mesh
    ):
        model, optimizer = M.make_mlp()
        before = M.flat_arrays(model)

        def fails(m, o):
            m.linear1.kernel[...] = m.linear1.kernel[...] + 1
            raise ValueError("raised inside")

        lifted = lift(meshlift_backend, fails, meshlift_mesh, (M.REPLICATED, M.REPLICATED))
        with pytest.raises(ValueError, match="raised inside"):
            lifted(model, optimizer)
        assert_arrays_equal(model, before, "after the lifted function raised")

    # -- identity changes inside, carried back as nnx.jit carries them ---------------------------
    def test_swap_inside_repoints_the_callers_attributes_and_copies_nothing(
        self, meshlift_backend, meshlift_mesh
    ):
        def swap(m):
            m.linear1, m.linear2 = m.linear2, m.linear1

        results = {}
        for how in ("eager", "nnx.jit", "meshlift"):
            model, _ = M.make_mlp()
            first, second = model.linear1, model.linear2
            kernels = (np.asarray(first.kernel[...]), np.asarray(second.kernel[...]))
            if how == "eager":
                swap(model)
            elif how == "nnx.jit":
                M.graph_mode_jit(swap)(model)
            else:
                lift(meshlift_backend, swap, meshlift_mesh, (M.REPLICATED,), None)(model)
            results[how] = (model.linear1 is second, model.linear2 is first)
            # the objects were re-pointed, not overwritten: each keeps its own values
            np.testing.assert_array_equal(first.kernel[...], kernels[0], err_msg=how)
            np.testing.assert_array_equal(second.kernel[...], kernels[1], err_msg=how)
        assert results["meshlift"] == results["nnx.jit"] == results["eager"] == (True, True)

    def test_added_attribute_and_replaced_submodule_inside_are_carried_back(
        self, meshlift_backend, meshlift_mesh
    ):
        model, _ = M.make_mlp()
        old = model.linear2
        old_kernel = np.asarray(old.kernel[...])

        def grow(m):
            m.linear1.kernel[...] = m.linear1.kernel[...] * 0
            m.extra = nnx.Param(jnp.ones(3))
            m.linear2 = nnx.Linear(M.HIDDEN, M.WIDTH, use_bias=False, rngs=nnx.Rngs(9))

        lift(meshlift_backend, grow, meshlift_mesh, (M.REPLICATED,), None)(model)
        reference = M.make_mlp()[0]
        M.graph_mode_jit(grow)(reference)
        np.testing.assert_array_equal(model.extra[...], reference.extra[...])
        np.testing.assert_array_equal(model.linear1.kernel[...], reference.linear1.kernel[...])
        np.testing.assert_allclose(model.linear2.kernel[...], reference.linear2.kernel[...])
        assert model.linear2 is not old
        np.testing.assert_array_equal(old.kernel[...], old_kernel)  # the replaced one untouched

    # -- outer transforms ---------------------------------------------------------------------
    def test_update_under_an_outer_jit_raises_and_leaves_no_tracer(
        self, meshlift_backend, meshlift_mesh
    ):
        model, _ = M.make_mlp()
        before = M.flat_arrays(model)

        def bump(m, x):
            m.linear1.kernel[...] = m.linear1.kernel[...] + x

        step = lift(meshlift_backend, bump, meshlift_mesh, (M.REPLICATED, P()), None)
        with pytest.raises(ml.TraceLeakError, match=r"m\.linear1\.kernel"):
            jax.jit(lambda x: step(model, x))(1.0)
        for _, variable in M.flat_variables(model):
            assert not isinstance(variable.get_raw_value(), jax.core.Tracer)
        assert_arrays_equal(model, before, "after a refused update under an outer jit")

    def test_update_inside_nnx_jit_flows_out_through_it(self, meshlift_backend, meshlift_mesh):
        model, _ = M.make_mlp()
        expected = np.asarray(model.linear1.kernel[...]) + 1.0

        def bump(m):
            m.linear1.kernel[...] = m.linear1.kernel[...] + 1.0

        step = lift(meshlift_backend, bump, meshlift_mesh, (M.REPLICATED,), None)
        M.graph_mode_jit(lambda m: step(m))(model)
        np.testing.assert_allclose(model.linear1.kernel[...], expected, atol=M.TOLERANCE)

    # -- write-back is all or nothing -----------------------------------------------------------
    def test_variable_and_array_on_a_module_are_written_together(
        self, meshlift_backend, meshlift_mesh
    ):
        class Counter(nnx.Module):
            def __init__(self):
                self.a = nnx.Param(jnp.zeros(4))
                self.z = nnx.data(jnp.zeros(4))

        def bump(m):
            m.a[...] += 1
            m.z = m.z + 1

        model, reference = Counter(), Counter()
        lift(meshlift_backend, bump, meshlift_mesh, (M.REPLICATED,), None)(model)
        M.graph_mode_jit(bump)(reference)
        np.testing.assert_array_equal(model.a[...], reference.a[...])
        np.testing.assert_array_equal(model.z, reference.z)

    def test_dropped_models_are_freed(self, meshlift_backend, meshlift_mesh):
        forward = lift(meshlift_backend, lambda m, x: m(x), meshlift_mesh, (M.REPLICATED, P()), P())
        refs = []
        for seed in range(3):
            model = nnx.Linear(M.WIDTH, M.WIDTH, rngs=nnx.Rngs(seed))
            forward(model, jnp.ones((2, M.WIDTH)))
            refs.append(weakref.ref(model))
            del model
        gc.collect()
        alive = [i for i, ref in enumerate(refs) if ref() is not None]
        assert not alive, f"models {alive} are still alive after being dropped"

    def test_submodule_replaced_between_calls_is_used(
        self, meshlift_backend, meshlift_mesh, meshlift_per_shard
    ):
        model, _ = M.make_mlp()
        x, _ = M.batch()
        forward = lift(
            meshlift_backend,
            lambda m, x: M.forward(m, x, per_shard=meshlift_per_shard),
            meshlift_mesh,
            (M.TENSOR_PARALLEL, P("data")),
            P("data"),
        )
        forward(model, x)
        model.linear2 = nnx.Linear(M.HIDDEN, M.WIDTH, use_bias=False, rngs=nnx.Rngs(7))
        expected = M.forward(model, x)
        np.testing.assert_allclose(forward(model, x), expected, atol=M.TOLERANCE)

    # -- shared references ----------------------------------------------------------------------
    def test_shared_module_inside_an_argument_stays_shared(self, meshlift_backend, meshlift_mesh):
        class Tied(nnx.Module):
            def __init__(self):
                self.embed = nnx.Linear(M.WIDTH, M.WIDTH, rngs=nnx.Rngs(0))
                self.head = self.embed

        tied = Tied()
        before = np.asarray(tied.embed.kernel[...])

        def double(t):
            t.head.kernel[...] = t.embed.kernel[...] * 2

        lift(meshlift_backend, double, meshlift_mesh, (M.REPLICATED,), None)(tied)
        assert tied.head is tied.embed
        np.testing.assert_allclose(tied.embed.kernel[...], before * 2, atol=M.TOLERANCE)

    def test_module_passed_twice_is_one_object_inside(self, meshlift_backend, meshlift_mesh):
        model, _ = M.make_mlp()
        before = np.asarray(model.linear1.bias[...])

        def bump_both(a, b):
            assert a is b, "a module passed twice must be one object inside"
            a.linear1.bias[...] = a.linear1.bias[...] + 1
            b.linear1.bias[...] = b.linear1.bias[...] + 1

        plan = M.TENSOR_PARALLEL
        lift(meshlift_backend, bump_both, meshlift_mesh, (plan, plan), None)(model, model)
        np.testing.assert_allclose(model.linear1.bias[...], before + 2, atol=M.TOLERANCE)

    def test_shared_variable_given_two_specs_names_both_paths(
        self, meshlift_backend, meshlift_mesh
    ):
        class Tied(nnx.Module):
            def __init__(self):
                self.embed = nnx.Linear(M.WIDTH, M.WIDTH, rngs=nnx.Rngs(0))
                self.head = self.embed

        plan = ml.StateSharding(
            {
                ml.path_endswith("embed", "kernel"): P(None, "model"),
                ml.path_endswith("head", "kernel"): P("model", None),
                ...: P(),
            }
        )
        with pytest.raises(ml.PlanError, match=r"`t\.embed\.kernel` and `t\.head\.kernel`"):
            lift(meshlift_backend, lambda t: None, meshlift_mesh, (plan,), None)(Tied())

    # -- stages ---------------------------------------------------------------------------------
    def test_same_structure_is_traced_once(
        self, meshlift_backend, meshlift_mesh, meshlift_train_step
    ):
        traces = []
        train = meshlift_train_step

        def step(model, optimizer, x, y):
            traces.append(1)
            return train(model, optimizer, x, y)

        plan = M.TENSOR_PARALLEL
        lifted = lift(meshlift_backend, step, meshlift_mesh, (plan, plan, P("data"), P("data")))
        x, y = M.batch()
        lifted(*M.make_mlp(), x, y)
        lifted(*M.make_mlp(seed=1), x, y)  # a fresh model and optimizer of the same structure
        assert len(traces) == 1, f"traced {len(traces)} times for one argument structure"

    def test_eval_shape_gives_abstract_outputs_and_writes_nothing(
        self, meshlift_backend, meshlift_mesh, meshlift_per_shard
    ):
        model, _ = M.make_mlp()
        before = M.flat_arrays(model)

        def bump_and_make(m, x):
            m.linear1.bias[...] = m.linear1.bias[...] + 1
            return nnx.Linear(3, 5, rngs=nnx.Rngs(0)), M.forward(m, x, per_shard=meshlift_per_shard)

        lifted = lift(
            meshlift_backend,
            bump_and_make,
            meshlift_mesh,
            (M.TENSOR_PARALLEL, P("data")),
            (P(), P("data")),  # a plan here would be resolved by tracing outside the backend
        )
        layer, out = lifted.eval_shape(model, M.batch()[0])
        assert isinstance(layer, nnx.Linear)
        kernel = layer.kernel.get_value()
        assert (kernel.shape, kernel.dtype) == ((3, 5), jnp.float32)
        assert (out.shape, out.dtype) == ((M.BATCH, M.WIDTH), jnp.float32)
        assert_arrays_equal(model, before, "after eval_shape")

    def test_differentiable_from_outside(self, meshlift_backend, meshlift_mesh, meshlift_per_shard):
        model, _ = M.make_mlp()
        x, _ = M.batch()
        forward = lift(
            meshlift_backend,
            lambda m, x: M.forward(m, x, per_shard=meshlift_per_shard),
            meshlift_mesh,
            (M.TENSOR_PARALLEL, P("data")),
            P("data"),
        )
        # The first call is under an outer jit: nothing traced may leak into the model.
        grad = jax.jit(jax.grad(lambda x: jnp.sum(forward(model, x) ** 2)))(x)
        assert all(not isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(nnx.state(model)))
        reference = M.make_mlp()[0]
        expected = jax.grad(lambda x: jnp.sum(M.forward(reference, x) ** 2))(x)
        np.testing.assert_allclose(grad, expected, atol=M.TOLERANCE)

    @requires("stages")
    def test_trace_lower_compile_and_call_compiled_with_modules(
        self, meshlift_backend, meshlift_mesh, meshlift_train_step
    ):
        model, optimizer = M.make_mlp()
        x, y = M.batch()
        plan = M.TENSOR_PARALLEL
        step = lift(
            meshlift_backend,
            meshlift_train_step,
            meshlift_mesh,
            (plan, plan, P("data"), P("data")),
        )
        traced = step.trace(model, optimizer, x, y)
        assert "dot_general" in str(traced.jaxpr)
        lowered = traced.lower()
        assert "dot_general" in lowered.as_text()
        compiled = lowered.compile()
        assert isinstance(compiled.as_text(), str)
        assert int(optimizer.step[...]) == 0, "tracing, lowering and compiling write nothing"
        loss = compiled(model, optimizer, x, y)
        ref_losses, _ = M.reference_training()
        where = f"calling Compiled under {claims(meshlift_backend)}"
        np.testing.assert_allclose(float(loss), ref_losses[0], atol=M.TOLERANCE, err_msg=where)
        assert int(optimizer.step[...]) == 1, "calling the Compiled object writes back"
        assert_placed(model, plan, meshlift_mesh, "model after calling Compiled")
        again = step.lower(model, optimizer, x, y).compile()(model, optimizer, x, y)
        np.testing.assert_allclose(float(again), ref_losses[1], atol=M.TOLERANCE, err_msg=where)

    @requires("donation")
    def test_donated_buffers_are_reused_and_written_back(
        self, meshlift_backend, meshlift_mesh, meshlift_train_step
    ):
        model, optimizer = M.make_mlp()
        x, y = M.batch()
        plan = M.TENSOR_PARALLEL
        step = lift(
            meshlift_backend,
            meshlift_train_step,
            meshlift_mesh,
            (plan, plan, P("data"), P("data")),
            donate_argnums=(0, 1),
        )
        step(model, optimizer, x, y)  # the first call may move arrays onto the plan's shardings
        old = model.linear1.kernel[...]
        step(model, optimizer, x, y)
        assert old.is_deleted(), "the donated parameter buffer was not consumed"
        assert not model.linear1.kernel[...].is_deleted()
        assert int(optimizer.step[...]) == 2
        _, ref_arrays = M.reference_training()
        expected = {p: v for p, v in ref_arrays.items() if p[0] != "optimizer"}
        assert_arrays_equal(
            model, expected, f"after 2 donated steps under {claims(meshlift_backend)}"
        )

    # -- errors ---------------------------------------------------------------------------------
    @pytest.mark.parametrize(
        ("spec", "problem"),
        [
            (P(None, "nope"), "'nope'"),
            (P("data", None, None), "rank"),
            (P(None, ("data", "model", "data")), "twice"),
        ],
        ids=["unknown-axis", "too-long", "axis-twice"],
    )
    def test_bad_plan_names_the_path_shape_spec_and_mesh(
        self, meshlift_backend, meshlift_mesh, spec, problem
    ):
        model, _ = M.make_mlp()
        plan = ml.StateSharding({ml.path_endswith("linear1", "kernel"): spec, ...: P()})
        lifted = lift(meshlift_backend, lambda model: None, meshlift_mesh, (plan,), None)
        with pytest.raises(ml.PlanError) as info:
            lifted(model)
        text = str(info.value)
        for part in ("`model.linear1.kernel`", str((M.WIDTH, M.HIDDEN)), str(spec), problem):
            assert part in text, f"{part!r} missing from the error: {text}"
        assert str(dict(meshlift_mesh.shape)) in text, f"the mesh is missing from: {text}"

    def test_indivisible_dimension_names_the_path(self, meshlift_backend, meshlift_mesh):
        params = {"odd": jnp.ones((3, M.WIDTH))}
        lifted = lift(meshlift_backend, lambda p: None, meshlift_mesh, (P("data"),), None)
        with pytest.raises(ml.PlanError, match=r"`p\.odd`[\s\S]*divisible"):
            lifted(params)

    def test_plan_missing_a_parameter_names_its_path(self, meshlift_backend, meshlift_mesh):
        plan = ml.StateSharding({ml.path_endswith("linear1", "kernel"): P(None, "model")})
        with pytest.raises(ml.PlanError, match=r"linear1\.bias"):
            lift(meshlift_backend, lambda m: None, meshlift_mesh, (plan,), None)(M.make_mlp()[0])

    def test_spec_tree_not_matching_the_arguments_says_where(self, meshlift_backend, meshlift_mesh):
        params = {"a": jnp.ones(8), "b": jnp.ones(8)}
        lifted = lift(meshlift_backend, lambda p: None, meshlift_mesh, ({"a": P()},), None)
        with pytest.raises(ml.PlanError, match="does not match"):
            lifted(params)

    # -- the differential oracle --------------------------------------------------------------
    @oracle.budget(50)
    @given(program=oracle.graph_programs())
    def test_generated_programs_run_as_they_run_eagerly(self, meshlift_backend, program):
        # Generated models, argument layouts and changes (meshlift.testing.oracle), under the
        # oracle's plan on a 2x4 mesh (replicated for a backend that runs per shard): the
        # same outputs, state and object identities as eager.
        oracle.check(program, meshlift_backend)

    # -- the libraries' own objects (the ecosystem corpus: `nox -s corpus` runs it all) -------
    @pytest.mark.parametrize("case", LIBRARY_OBJECTS)
    def test_library_objects_run_as_under_nnx_jit(
        self, meshlift_backend, meshlift_mesh, meshlift_per_shard, case
    ):
        plan = "replicated" if meshlift_per_shard else "metadata"
        corpus.check(case, meshlift_backend, meshlift_mesh, plan)
