"""GraphSplit, fingerprint and is_graph_leaf on real NNX modules, optimizers and Rngs.

Most GraphSplit tests run three times: on the fast path (flax's raw Variable
slot, pinned to tested flax versions), read and written by the C loops of
`meshlift.speedups` and by their Python twins, and on the public-API fallback,
selected by a flax without the private slots (`compat.variable_slots` gives None).
"""

import collections
import dataclasses
import functools
import subprocess
import sys
from array import array as typed_array

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshlift as ml
from meshlift import compat, speedups
from meshlift.graph import dict_watch
from meshlift.graph.split import GraphSplit, Rebuilt, is_graph_leaf
from meshlift.graph.structure import fingerprint


class MLP(nnx.Module):
    def __init__(self, width=4, *, seed=0):
        rngs = nnx.Rngs(seed)
        self.linear = nnx.Linear(2, width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, deterministic=False)
        self.layers = nnx.List(
            [nnx.Linear(width, width, rngs=rngs), nnx.Linear(width, 2, rngs=rngs)]
        )


class Tied(nnx.Module):
    """``b`` is the same Variable as ``a`` when ``tie``; an equal but separate one otherwise."""

    def __init__(self, tie=True):
        self.a = nnx.Param(jnp.arange(3.0))
        self.b = self.a if tie else nnx.Param(jnp.arange(3.0))


def model_and_optimizer(width=4, lr=1e-3, seed=0):
    model = MLP(width, seed=seed)
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def index(split, *path):
    return split.paths.index(path)


# 6 model Params, and in Adam's state: count, mu (6), nu (6), plus the optimizer's step.
N_VARIABLES = 20


@pytest.fixture(params=["fast", "fast, Python loops", "public-api"])
def path_kind(request, monkeypatch):
    """Run on the fast path (with the C loops of `meshlift.speedups`, and with their Python
    twins, as installed without a compiler), and on the public-API fallback."""
    if request.param == "public-api":
        monkeypatch.setattr(compat, "variable_slots", lambda: None)
    if request.param == "fast, Python loops":
        use_python_loops(monkeypatch)
    return request.param


def use_python_loops(monkeypatch):
    """`meshlift.speedups` as installed without a C compiler: the pure-Python twins."""
    loops = ("read_each", "read_each_is", "write_each", "same_dicts", "same_items")
    for name in (*loops, "same_structure"):
        monkeypatch.setattr(speedups, name, getattr(speedups, f"_{name}"))
    monkeypatch.setattr(dict_watch, "versions_available", lambda: False)  # read in C only


STRUCTURE_CHECKS = [
    "comparison",
    "comparison, Python loops",
    *(["dict watchers"] if dict_watch.available() else []),
    *(["dict version tags"] if dict_watch.versions_available() else []),
]


@pytest.fixture(params=STRUCTURE_CHECKS)
def structure_check(request, monkeypatch):
    """Check structure as dicts tell of their changes (dict watchers on CPython 3.12, version
    tags on 3.11) and by comparing every item (elsewhere), in C and in Python."""
    if request.param.startswith("comparison"):
        monkeypatch.setattr(dict_watch, "available", lambda: False)
        monkeypatch.setattr(dict_watch, "versions_available", lambda: False)
    if request.param.endswith("Python loops"):
        use_python_loops(monkeypatch)
    return request.param


def make_split(nodes, path_kind):
    split = GraphSplit(nodes)
    assert split.fast is (path_kind != "public-api")
    return split


# -- gather --------------------------------------------------------------------


def test_fast_path_is_on_where_flax_has_the_slots_and_off_for_arrays_on_modules():
    model, opt = model_and_optimizer()
    assert GraphSplit((model, opt)).fast is (compat.variable_slots() is not None)

    class Raw(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.raw = nnx.data(jnp.zeros(3))

    assert GraphSplit((Raw(),)).fast is False


def test_import_survives_a_flax_without_the_private_slots():
    # As if a later flax renamed Variable's slots: meshlift imports, and the probe says no.
    code = (
        "from flax import nnx\n"
        "delattr(nnx.Variable, '_raw_value')\n"
        "import meshlift as ml\n"
        "from meshlift import compat\n"
        "assert compat.variable_slots() is None\n"
        "assert ml.jit is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_gather_returns_each_variables_array_in_split_order(path_kind):
    model, opt = model_and_optimizer()
    split = make_split((model, opt), path_kind)
    arrays = split.gather()

    assert len(arrays) == len(split.leaves) == len(split.paths) == N_VARIABLES
    for array, variable in zip(arrays, split.leaves, strict=True):
        assert isinstance(array, jax.Array)
        assert array is variable.get_raw_value()
    kernel = index(split, 0, "linear", "kernel")
    assert split.leaves[kernel] is model.linear.kernel
    assert split.leaves[index(split, 0, "layers", 1, "bias")] is model.layers[1].bias
    assert split.leaves[index(split, 1, "step")] is opt.step
    assert (
        split.leaves[index(split, 1, "opt_state", 0, "mu", "linear", "kernel")]
        is (opt.opt_state[0].mu["linear"]["kernel"])
    )


def test_gather_sees_value_updates_made_between_calls(path_kind):
    model, opt = model_and_optimizer()
    split = make_split((model, opt), path_kind)
    model.linear.kernel[...] = jnp.full((2, 4), 7.0)
    opt.step[...] = 5

    arrays = split.gather()
    np.testing.assert_array_equal(arrays[index(split, 0, "linear", "kernel")], np.full((2, 4), 7.0))
    assert int(arrays[index(split, 1, "step")]) == 5


def test_tied_variable_appears_once(path_kind):
    model = Tied(tie=True)
    split = make_split((model,), path_kind)

    assert split.paths == ((0, "a"),)
    assert split.leaves == (model.a,)
    (array,) = split.gather()
    np.testing.assert_array_equal(array, [0.0, 1.0, 2.0])

    split.scatter([0], [jnp.full(3, 9.0)], (model,))
    assert model.b is model.a
    np.testing.assert_array_equal(model.b[...], np.full(3, 9.0))


def test_untied_equal_variables_appear_twice():
    split = GraphSplit((Tied(tie=False),))
    assert split.paths == ((0, "a"), (0, "b"))


def test_kernel_shared_between_two_layers_appears_once(path_kind):
    model = MLP()
    model.layers[1] = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
    model.layers[1].kernel = model.layers[0].kernel
    split = make_split((model,), path_kind)

    assert (0, "layers", 0, "kernel") in split.paths
    assert (0, "layers", 1, "kernel") not in split.paths
    assert len(split.gather()) == 5  # linear: 2, layers.0: 2, layers.1: bias only


def test_node_shared_between_arguments_appears_once(path_kind):
    model, opt = model_and_optimizer()
    alone = make_split((model, opt), path_kind)
    shared = make_split((model, opt, model.linear, model.linear.kernel), path_kind)

    assert shared.paths == alone.paths
    assert len(shared.gather()) == N_VARIABLES


# -- scatter -------------------------------------------------------------------


def test_scatter_writes_into_the_callers_variables(path_kind):
    model, opt = model_and_optimizer()
    split = make_split((model, opt), path_kind)
    kernel, bias, step = model.linear.kernel, model.linear.bias, opt.step
    old_bias = bias[...]
    values = [jnp.full((2, 4), 3.0), jnp.array(11, dtype=jnp.uint32)]
    split.scatter(
        [index(split, 0, "linear", "kernel"), index(split, 1, "step")], values, (model, opt)
    )

    assert model.linear.kernel is kernel and opt.step is step and model.linear.bias is bias
    np.testing.assert_array_equal(model.linear.kernel[...], np.full((2, 4), 3.0))
    assert int(opt.step[...]) == 11
    np.testing.assert_array_equal(model.linear.bias[...], old_bias)  # not in indices: untouched
    assert split.unchanged()


def test_gather_then_scatter_round_trips(path_kind):
    model, opt = model_and_optimizer()
    split = make_split((model, opt), path_kind)
    doubled = [a * 2 for a in split.gather()]
    split.scatter(range(len(doubled)), doubled, (model, opt))
    for got, want in zip(split.gather(), doubled, strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_array_stored_on_a_module_is_a_leaf_of_the_split():
    class Raw(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.raw = nnx.data(jnp.zeros(3))

    model = Raw()
    split = GraphSplit((model,))
    assert [a.shape for a in split.gather()] == [(3,), (2,)]
    assert split.leaves[index(split, 0, "raw")] is model.raw
    split.scatter([index(split, 0, "w")], [jnp.full(2, 4.0)], (model,))
    np.testing.assert_array_equal(model.w[...], np.full(2, 4.0))


# -- unchanged -----------------------------------------------------------------


def _set_kernel(model, opt):
    model.linear.kernel[...] = jnp.ones((2, 4))


def _set_kernel_value(model, opt):
    model.linear.kernel.set_value(jnp.ones((2, 4)))


def _optimizer_update(model, opt):
    opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))


def _nnx_update(model, opt):
    nnx.update(model, nnx.state(MLP(seed=1)))


def _same_static_value(model, opt):
    model.drop.deterministic = False
    model.linear.in_features = 2


VALUE_UPDATES = {
    "kernel[...] =": _set_kernel,
    "kernel.set_value": _set_kernel_value,
    "optimizer.update": _optimizer_update,
    "nnx.update": _nnx_update,
    "same static value": _same_static_value,
}


@pytest.mark.parametrize("update", VALUE_UPDATES.values(), ids=VALUE_UPDATES.keys())
def test_unchanged_after_value_updates(update, path_kind):
    model, opt = model_and_optimizer()
    split = make_split((model, opt), path_kind)
    before = split.gather()
    update(model, opt)
    assert split.unchanged()
    if update is not _same_static_value:
        assert any(a is not b for a, b in zip(before, split.gather(), strict=True))


def test_unchanged_after_drawing_from_rngs():
    rngs = nnx.Rngs(0, dropout=1)
    split = GraphSplit((rngs,))
    count = split.gather()[index(split, 0, "dropout", "count")]
    rngs.dropout()
    assert split.unchanged()
    assert int(split.gather()[index(split, 0, "dropout", "count")]) == int(count) + 1


STRUCTURAL_CHANGES = {
    "replace submodule": lambda m, o: setattr(m, "linear", nnx.Linear(2, 4, rngs=nnx.Rngs(1))),
    "add Param attribute": lambda m, o: setattr(m, "extra", nnx.Param(jnp.ones(2))),
    "add static attribute": lambda m, o: setattr(m, "flag", True),
    "delete attribute": lambda m, o: delattr(m, "drop"),
    "replace Variable by equal one": lambda m, o: setattr(
        m.linear, "kernel", nnx.Param(m.linear.kernel[...])
    ),
    "assign array over Variable": lambda m, o: setattr(m.linear, "kernel", jnp.ones((2, 4))),
    "Dropout.deterministic": lambda m, o: setattr(m.drop, "deterministic", True),
    "Dropout.rate": lambda m, o: setattr(m.drop, "rate", 0.5),
    "model.eval()": lambda m, o: m.eval(),
    "Linear.in_features": lambda m, o: setattr(m.linear, "in_features", 5),
    "nnx.List entry": lambda m, o: m.layers.__setitem__(0, nnx.Linear(4, 4, rngs=nnx.Rngs(2))),
    "nnx.List append": lambda m, o: m.layers.append(nnx.Linear(2, 2, rngs=nnx.Rngs(2))),
    "nnx.List pop": lambda m, o: m.layers.pop(),
    "optimizer tx": lambda m, o: setattr(o, "tx", optax.sgd(1e-3)),
    # obj.__dict__ = {...}: another dict, which no watcher of the old one sees
    "Dropout's __dict__ swapped": lambda m, o: object.__setattr__(
        m.drop, "__dict__", {**vars(m.drop), "rate": 0.5}
    ),
}


@pytest.mark.parametrize("change", STRUCTURAL_CHANGES.values(), ids=STRUCTURAL_CHANGES.keys())
@pytest.mark.usefixtures("structure_check")
def test_structural_change_is_detected(change):
    model, opt = model_and_optimizer()
    split = GraphSplit((model, opt))
    assert split.unchanged()
    change(model, opt)
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_replacing_an_nnx_dict_entry_is_detected():
    class Heads(nnx.Module):
        def __init__(self):
            self.heads = nnx.Dict(a=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))

    model = Heads()
    split = GraphSplit((model,))
    model.heads["a"] = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_replacing_an_entry_of_a_plain_list_attribute_is_detected():
    class Blocks(nnx.Module):
        def __init__(self):
            self.blocks = nnx.data([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])

    model = Blocks()
    split = GraphSplit((model,))
    model.blocks[0] = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_replacing_a_variable_inside_an_nnx_state_is_detected():
    state = nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    split = GraphSplit((state,))
    assert split.paths == ((0, "bias"), (0, "kernel"))
    state["kernel"] = nnx.Param(jnp.zeros((2, 2)))
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_variable_metadata_is_part_of_the_key():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    split = GraphSplit((model,))
    model.kernel.set_metadata(out_sharding=(None, "model"))
    assert GraphSplit((model,)).key != split.key


@pytest.mark.usefixtures("structure_check")
def test_variable_metadata_change_is_detected():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    split = GraphSplit((model,))
    model.kernel.set_metadata(out_sharding=(None, "model"))
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_mutable_metadata_value_changed_in_place_is_detected():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    model.kernel.set_metadata(tags=["encoder"])
    split = GraphSplit((model,))
    model.kernel.tags.append("frozen")
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_variable_metadata_replaced_by_a_new_dict_is_detected():
    # set_metadata(mapping) swaps the Variable's metadata dict instead of changing it
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    split = GraphSplit((model,))
    model.kernel.set_metadata(model.kernel.get_metadata() | {"out_sharding": (None, "model")})
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_an_equal_metadata_dict_is_followed_for_later_changes():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    split = GraphSplit((model,))
    model.kernel.set_metadata(model.kernel.get_metadata())  # a new dict, equal: no change
    assert split.unchanged()
    model.kernel.set_metadata(out_sharding=(None, "model"))  # changes that new dict in place
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_a_change_stays_detected_until_the_split_is_remade():
    model, opt = model_and_optimizer()
    split = GraphSplit((model, opt))
    model.linear = nnx.Linear(2, 4, rngs=nnx.Rngs(1))
    assert not split.unchanged()
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_a_metadata_change_stays_detected_until_the_split_is_remade():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    split = GraphSplit((model,))
    model.kernel.set_metadata(out_sharding=(None, "model"))
    assert not split.unchanged()
    assert not split.unchanged()
    assert GraphSplit((model,)).unchanged()


@pytest.mark.usefixtures("structure_check")
def test_metadata_set_to_an_equal_value_is_no_change_and_later_changes_are_seen():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    model.kernel.set_metadata(out_sharding=(None, "model"))
    split = GraphSplit((model,))
    model.kernel.set_metadata(out_sharding=tuple([None, "model"]))  # equal, another tuple
    assert split.unchanged()
    assert split.unchanged()
    model.kernel.set_metadata(out_sharding=("model", None))
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_reordering_an_ordered_dict_attribute_is_detected():
    class Table(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.order = collections.OrderedDict(a=1, b=2)

    model = Table()
    split = GraphSplit((model,))
    assert split.unchanged()
    model.order.move_to_end("a")  # its order lives outside the dict: no watcher sees it
    assert not split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_tracing_and_calling_leave_the_split_unchanged():
    # flax's per-object trace state changes on every trace: it is not structure
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    split = GraphSplit((model,))
    x = jnp.ones((1, 2))
    ml.jit(lambda m: m(x))(model)
    jax.grad(lambda m: m(x).sum())(model)
    assert split.unchanged()


@dataclasses.dataclass
class Config:
    scale: float = 1.0


class Configured(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.config = Config()


@pytest.mark.usefixtures("structure_check")
def test_static_dataclass_mutated_in_place_is_detected():
    model = Configured()
    split = GraphSplit((model,))
    model.config.scale = 3.0
    assert GraphSplit((model,)).key != split.key
    assert not split.unchanged()


IN_PLACE = {  # (a container a static value holds, a change to it in place)
    "deque append": (lambda: collections.deque([1.0]), lambda c: c.append(2.0)),
    "bytearray item": (lambda: bytearray(b"\x01"), lambda c: c.__setitem__(0, 2)),
    "array.array item": (lambda: typed_array("d", [1.0]), lambda c: c.__setitem__(0, 2.0)),
    "NumPy array item": (lambda: np.ones(4), lambda c: c.__setitem__(0, 2.0)),
    "NumPy array reshaped": (lambda: np.ones(4), lambda c: c.resize((2, 2), refcheck=False)),
}


@pytest.mark.parametrize(("make", "change"), IN_PLACE.values(), ids=IN_PLACE)
@pytest.mark.usefixtures("structure_check")
def test_a_container_in_a_static_value_changed_in_place_is_detected(make, change):
    model = Configured()
    model.config.scale = make()
    split = GraphSplit((model,))
    assert split.unchanged() and split.unchanged()  # nothing changed: no miss
    change(model.config.scale)
    assert not split.unchanged()
    assert GraphSplit((model,)).key != split.key


@pytest.mark.usefixtures("structure_check")
def test_a_numpy_array_in_a_pytree_is_data_not_structure():
    model = Configured()
    model.config = nnx.data({"table": np.ones(4)})  # a dict: a pytree, whose leaves are data
    split = GraphSplit((model,))
    model.config["table"][0] = 2.0
    assert split.unchanged()


@pytest.mark.usefixtures("structure_check")
def test_an_attribute_dict_swapped_for_another_is_detected_even_if_equal():
    model = Configured()
    split = GraphSplit((model,))
    model.config.__dict__ = {"scale": 3.0}
    assert not split.unchanged()
    split = GraphSplit((model,))
    model.config.__dict__ = dict(vars(model.config))  # equal: a new split finds the same key
    assert not split.unchanged()
    assert GraphSplit((model,)).key == split.key


# -- rebuild and index_map -----------------------------------------------------


def test_rebuild_gives_new_objects_with_the_given_values_and_same_structure():
    model, opt = model_and_optimizer()
    split = GraphSplit((model, opt))
    values = [jnp.full(a.shape, i, a.dtype) for i, a in enumerate(split.gather())]

    new_model, new_opt = Rebuilt(split.graphdef, values).nodes

    assert type(new_model) is MLP and type(new_opt) is nnx.Optimizer
    assert new_model is not model and new_opt is not opt
    assert new_model.linear.kernel is not model.linear.kernel
    assert new_model.layers[1] is not model.layers[1]
    again = GraphSplit((new_model, new_opt))
    assert again.paths == split.paths
    assert again.key == split.key
    for got, want in zip(again.gather(), values, strict=True):
        np.testing.assert_array_equal(got, want)
    k = index(split, 0, "linear", "kernel")
    assert not np.array_equal(model.linear.kernel[...], values[k])  # the caller's are untouched


def test_rebuild_keeps_ties():
    split = GraphSplit((Tied(tie=True),))
    (rebuilt,) = Rebuilt(split.graphdef, [jnp.full(3, 5.0)]).nodes
    assert rebuilt.b is rebuilt.a
    np.testing.assert_array_equal(rebuilt.b[...], np.full(3, 5.0))


def test_rebuild_inside_jit_runs_the_model_on_tracers():
    model = MLP()
    split = GraphSplit((model,))
    x = jnp.ones((3, 2))

    @jax.jit
    def forward(values, x):
        (rebuilt,) = Rebuilt(split.graphdef, values).nodes
        return rebuilt.layers[0](rebuilt.linear(x))

    np.testing.assert_allclose(
        forward(split.gather(), x), model.layers[0](model.linear(x)), rtol=1e-6
    )


def test_index_map_resolves_to_the_callers_objects():
    model, opt = model_and_optimizer()
    split = GraphSplit((model, opt))
    nodes = {id(node) for node in split.index_map((model, opt)).values()}
    for obj in (model, opt, model.linear, model.layers[0], model.linear.kernel, opt.step):
        assert id(obj) in nodes


# -- key and fingerprint -------------------------------------------------------


def test_key_is_equal_for_independently_built_models_of_the_same_structure():
    a = GraphSplit(model_and_optimizer(seed=0))
    b = GraphSplit(model_and_optimizer(seed=1))
    assert a.key == b.key
    assert hash(a.key) == hash(b.key)
    assert {a.key: "compiled"}[b.key] == "compiled"


@pytest.mark.parametrize(
    "other",
    [
        lambda: model_and_optimizer(width=8),
        lambda: model_and_optimizer(lr=1e-2),
        lambda: (MLP(),),
        lambda: (MLP().eval(), nnx.Optimizer(MLP(), optax.adam(1e-3), wrt=nnx.Param)),
    ],
    ids=["layer width", "learning rate", "no optimizer", "Dropout deterministic"],
)
def test_key_differs_when_the_structure_differs(other):
    assert GraphSplit(model_and_optimizer()).key != GraphSplit(other()).key


def test_key_tells_tied_from_untied_and_variable_types_apart():
    assert GraphSplit((Tied(tie=True),)).key != GraphSplit((Tied(tie=False),)).key

    class One(nnx.Module):
        def __init__(self, kind):
            self.v = kind(jnp.ones(2))

    assert GraphSplit((One(nnx.Param),)).key != GraphSplit((One(nnx.BatchStat),)).key
    assert GraphSplit((One(nnx.Param),)).key == GraphSplit((One(nnx.Param),)).key


def test_fingerprint_of_optax_transforms():
    assert fingerprint(optax.adam(1e-3)) == fingerprint(optax.adam(1e-3))
    assert hash(fingerprint(optax.adam(1e-3))) == hash(fingerprint(optax.adam(1e-3)))
    assert fingerprint(optax.adam(1e-3)) != fingerprint(optax.adam(1e-2))
    assert fingerprint(optax.adam(1e-3)) != fingerprint(optax.sgd(1e-3))
    assert fingerprint(optax.adam(1e-3)) != fingerprint(optax.adam(1e-3, b1=0.8))
    clipped = lambda c: optax.chain(optax.clip_by_global_norm(c), optax.adam(1e-3))  # noqa: E731
    assert fingerprint(clipped(1.0)) == fingerprint(clipped(1.0))
    assert fingerprint(clipped(1.0)) != fingerprint(clipped(2.0))
    schedule = lambda: optax.linear_schedule(1e-3, 0.0, 10)  # noqa: E731
    assert fingerprint(optax.adam(schedule())) == fingerprint(optax.adam(schedule()))


def test_fingerprint_of_functions_compares_code_and_closed_over_values():
    def scaled(k):
        return lambda x: x * k

    assert fingerprint(scaled(2)) == fingerprint(scaled(2))
    assert fingerprint(scaled(2)) != fingerprint(scaled(3))
    assert fingerprint(lambda x: x + 1) != fingerprint(lambda x: x - 1)
    defaults = [lambda x, k=k: x * k for k in range(2)]
    assert fingerprint(defaults[0]) != fingerprint(defaults[1])
    assert fingerprint(functools.partial(max, 1)) == fingerprint(functools.partial(max, 1))
    assert fingerprint(functools.partial(max, 1)) != fingerprint(functools.partial(max, 2))


def test_fingerprint_of_a_recursive_closure_terminates():
    def make():
        def countdown(n):
            return countdown(n - 1) if n else 0

        return countdown

    assert fingerprint(make()) == fingerprint(make())


def test_fingerprint_of_values():
    assert fingerprint(1) != fingerprint(True)
    assert fingerprint(1) != fingerprint(1.0)
    assert fingerprint([1, 2]) != fingerprint((1, 2))
    assert fingerprint({"a": 1}) == fingerprint({"a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert fingerprint(Config(1.0)) == fingerprint(Config(1.0))
    assert fingerprint(Config(1.0)) != fingerprint(Config(2.0))
    assert fingerprint(np.ones(2)) == fingerprint(np.ones(2))  # by contents, not identity
    assert fingerprint(np.ones(2)) != fingerprint(np.zeros(2))


def test_fingerprint_of_a_closure_with_an_empty_cell():
    def outer():
        def f(x):
            return helper(x)

        key = fingerprint(f)

        def helper(x):
            return x

        return key

    hash(outer())


# -- is_graph_leaf -------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        lambda: MLP(),
        lambda: nnx.Param(jnp.ones(2)),
        lambda: nnx.BatchStat(jnp.ones(2)),
        lambda: nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param),
        lambda: nnx.Rngs(0),
        lambda: nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0))]),
    ],
    ids=["Linear", "Module subclass", "Param", "BatchStat", "Optimizer", "Rngs", "nnx.List"],
)
def test_is_graph_leaf_true(make):
    assert is_graph_leaf(make()) is True


@pytest.mark.parametrize(
    "value",
    [jnp.ones(2), np.ones(2), {"w": jnp.ones(2)}, (jnp.ones(2),), [1], 3, None],
    ids=["jax array", "numpy array", "dict", "tuple", "list", "int", "None"],
)
def test_is_graph_leaf_false(value):
    assert is_graph_leaf(value) is False
