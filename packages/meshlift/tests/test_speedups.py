"""meshlift.speedups: the C loops and their pure-Python twins give the same results.

Every case runs on both; the C extension must have been built here (the
noxfile installs meshlift, which compiles it), so that the suite measures
what users get.
"""

import collections
import inspect
import types
import weakref

import jax.numpy as jnp
import pytest
from flax import nnx

from meshlift import _speedups, compat, speedups
from meshlift.graph import dict_watch

TWINS = {
    "C": _speedups,
    "Python": type(
        "Twins",
        (),
        {name: staticmethod(getattr(speedups, f"_{name}")) for name in speedups.LOOPS}
        | {"CallPlan": speedups._CallPlan},
    ),
}


@pytest.fixture(params=TWINS, ids=TWINS)
def impl(request):
    return TWINS[request.param]


class Box:
    __slots__ = ("item",)

    def __init__(self, item=None):
        self.item = item


SLOT = inspect.getattr_static(Box, "item")


def test_the_extension_is_built_and_used():
    assert speedups.COMPILED
    assert speedups.read_each is _speedups.read_each


def test_read_each(impl):
    a, b = object(), object()
    assert impl.read_each(SLOT, (Box(a), Box(b))) == (a, b)
    assert impl.read_each(SLOT, ()) == ()


def test_read_each_of_an_unset_slot_raises_attribute_error(impl):
    empty = Box()
    del empty.item
    with pytest.raises(AttributeError, match="item"):
        impl.read_each(SLOT, (Box(1), empty))


def test_read_each_checks_the_objects_type(impl):
    with pytest.raises(TypeError):
        impl.read_each(SLOT, (Box(1), object()))


def test_read_each_is(impl):
    a, b = object(), object()
    boxes = (Box(a), Box(b))
    assert impl.read_each_is(SLOT, boxes, (a, b))
    assert not impl.read_each_is(SLOT, boxes, (a, object()))
    assert not impl.read_each_is(SLOT, boxes, (a,))


def test_read_each_is_compares_identity_not_equality(impl):
    boxes = (Box([1, 2]),)
    assert not impl.read_each_is(SLOT, boxes, ([1, 2],))


def test_write_each(impl):
    boxes = (Box(1), Box(2))
    assert impl.write_each(SLOT, boxes, ("x", "y")) is None
    assert [box.item for box in boxes] == ["x", "y"]


def test_write_each_refuses_unequal_lengths_and_writes_nothing(impl):
    boxes = (Box(1), Box(2))
    with pytest.raises(ValueError, match="2 objects but 1 values"):
        impl.write_each(SLOT, boxes, ("x",))
    assert [box.item for box in boxes] == [1, 2]


def test_on_flax_variable_slots(impl):
    slots = compat.variable_slots()
    assert slots is not None
    variables = (nnx.Param(jnp.zeros(2), tag="a"), nnx.BatchStat(jnp.ones(3)))
    arrays = impl.read_each(slots.value, variables)
    assert arrays == tuple(v.get_raw_value() for v in variables)
    metadata = impl.read_each(slots.metadata, variables)
    assert metadata[0]["tag"] == "a"
    assert impl.read_each_is(slots.metadata, variables, metadata)
    new = (jnp.full(2, 5.0), jnp.full(3, 7.0))
    impl.write_each(slots.value, variables, new)
    assert all(v.get_raw_value() is x for v, x in zip(variables, new, strict=True))


def snapshot(dicts):
    dicts = tuple(dicts)
    keys = tuple(k for d in dicts for k in d)
    values = tuple(v for d in dicts for v in d.values())
    return dicts, tuple(map(len, dicts)), keys, values


def test_same_items_unchanged(impl):
    a, b = {"x": object(), "y": 1}, {"z": object()}
    assert impl.same_items(*snapshot([a, b]))
    assert impl.same_items(*snapshot([]))


CHANGES = {
    "value replaced": lambda a, b: a.__setitem__("x", object()),
    "value replaced by an equal one": lambda a, b: a.__setitem__("y", int(str(10**30))),
    "key added": lambda a, b: a.__setitem__("w", 0),
    "key removed": lambda a, b: a.pop("y"),
    "key renamed": lambda a, b: a.__setitem__("y2", a.pop("y")),
    "reordered": lambda a, b: a.__setitem__("x", a.pop("x")),
    # the flattened keys and values stay the same: only each dict's size tells
    "item moved to the next dict": lambda a, b: b.update([("y", a.pop("y")), ("z", b.pop("z"))]),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_same_items_sees_each_change(impl, change):
    a, b = {"x": object(), "y": 10**30}, {"z": object()}
    taken = snapshot([a, b])
    change(a, b)
    assert not impl.same_items(*taken)


def test_same_items_compares_keys_by_equality(impl):
    key = "".join(["na", "me"])
    value = object()
    taken = snapshot([{key: value}])
    rebuilt = {"".join(["nam", "e"]): value}  # an equal key, another string object
    assert impl.same_items((rebuilt,), *taken[1:])


class Config:
    """A plain object: its attributes live in its `__dict__`."""


def test_same_dicts_reads_each_holder_or_its_weak_referent(impl):
    held, root = Config(), Config()
    ref = weakref.ref(root)
    dicts = (vars(held), vars(root))
    assert impl.same_dicts((held, ref), dicts)
    assert impl.same_dicts((), ())
    assert not impl.same_dicts((held,), dicts)  # lengths differ
    root.__dict__ = dict(vars(root))  # an equal dict, another object
    assert not impl.same_dicts((held, ref), dicts)
    assert impl.same_dicts((held, ref), (vars(held), vars(root)))
    held.__dict__ = {}
    assert not impl.same_dicts((held, ref), (dicts[0], vars(root)))


def test_same_dicts_is_false_once_a_weak_referent_is_collected(impl):
    root = Config()
    ref, attributes = weakref.ref(root), vars(root)
    del root
    assert not impl.same_dicts((ref,), (attributes,))


def test_c_loops_take_tuples_only():
    with pytest.raises(TypeError, match="objects must be a tuple, not list"):
        _speedups.read_each(SLOT, [Box(1)])
    with pytest.raises(TypeError, match=r"expected dicts, got .*OrderedDict"):
        _speedups.same_items((collections.OrderedDict(a=1),), (1,), ("a",), (1,))


# -- a repeated call's plan ----------------------------------------------------------


class Node:
    """A graph node stand-in: anything a weak reference can point to."""


class Plan:
    """A CallPlan (of `impl`) over two boxes (the Variables), a node argument and a float
    argument; `replace(**fields)` makes it again with other fields."""

    def __init__(self, impl, **fields):
        self.impl = impl
        self.node, self.boxes, self.info = Node(), (Box(1.0), Box(2.0)), object()
        self.mesh = object()
        self.fields = dict(
            mesh_source=lambda: self.mesh,
            mesh=self.mesh,
            types=(Node, float),
            node_positions=(0,),
            node_refs=(weakref.ref(self.node),),
            unchanged=lambda: True,
            slot=SLOT,
            variables=self.boxes,
            dyn_positions=(1,),
            donated_variables=(),
            donated_dyn_positions=(),
            info=self.info,
            changed=(1,),
            targets=(self.boxes[1],),
            array_type=float,
            staged=None,
            entry=None,
        )
        self.replace(**fields)

    def replace(self, **fields):
        self.fields |= fields
        self.plan = self.impl.CallPlan(**self.fields)

    def outputs(self, *new, info=None):
        aux = types.SimpleNamespace(info=self.info if info is None else info)
        return (tuple(new), (), "user output", aux)


def test_plan_inputs_of_a_matching_call(impl):
    p = Plan(impl)
    assert impl.plan_inputs(p.plan, (p.node, 0.5)) == ((1.0, 2.0), (0.5,), (), ())
    assert impl.plan_matches(p.plan, (p.node, 0.5)) is True


@pytest.mark.parametrize(
    "change",
    [
        "another mesh",
        "mesh refused",
        "fewer arguments",
        "another type",
        "another node",
        "collected node",
        "structure changed",
    ],
)
def test_plan_inputs_miss(impl, change):
    p = Plan(impl)
    args = (p.node, 0.5)
    if change == "another mesh":
        p.mesh = object()
    elif change == "mesh refused":
        p.replace(mesh_source=lambda: 1 / 0)
    elif change == "fewer arguments":
        args = (p.node,)
    elif change == "another type":
        args = (p.node, 1)
    elif change == "another node":
        args = (Node(), 0.5)
    elif change == "collected node":
        p.replace(node_refs=(weakref.ref(Node()),))
    else:
        p.replace(unchanged=lambda: False)
    assert impl.plan_inputs(p.plan, args) is None
    # matching leaves the mesh to the caller; everything else must hold
    assert impl.plan_matches(p.plan, args) is (change in ("another mesh", "mesh refused"))


def test_a_plan_without_a_slot_only_matches(impl):
    p = Plan(impl, slot=None, variables=(), targets=(), info=None)
    assert impl.plan_inputs(p.plan, (p.node, 0.5)) is None
    assert impl.plan_matches(p.plan, (p.node, 0.5)) is True
    assert impl.plan_write(p.plan, p.outputs(None, 5.0)) is False
    assert [box.item for box in p.boxes] == [1.0, 2.0]


def test_plan_inputs_of_a_donating_call(impl):
    p = Plan(impl, dyn_positions=(), donated_dyn_positions=(1,))
    p.replace(variables=p.boxes[:1], donated_variables=p.boxes[1:])
    assert impl.plan_inputs(p.plan, (p.node, 0.5)) == ((1.0,), (), (2.0,), (0.5,))


@pytest.mark.parametrize("shared", ["donated twice", "donated and kept"])
def test_plan_inputs_miss_when_a_donated_input_is_shared(impl, shared):
    p = Plan(impl)
    if shared == "donated twice":  # two Variables hold one object
        p.boxes[1].item = p.boxes[0].item
        p.replace(variables=(), donated_variables=p.boxes)
    else:  # an argument that a kept Variable holds too
        p.boxes[0].item = 0.5
        p.replace(dyn_positions=(), donated_dyn_positions=(1,))
    assert impl.plan_inputs(p.plan, (p.node, p.boxes[0].item)) is None


def test_donated_alone():
    a, b = object(), object()
    assert speedups.donated_alone(((a,), (), (b,), ()))
    assert speedups.donated_alone(((), (), (), ()))
    assert not speedups.donated_alone(((), (), (a,), (a,)))
    assert not speedups.donated_alone(((), (a,), (a, b), ()))


def test_plan_inputs_lets_errors_that_are_no_exception_through(impl):
    def interrupted():
        raise KeyboardInterrupt

    p = Plan(impl, mesh_source=interrupted)
    with pytest.raises(KeyboardInterrupt):
        impl.plan_inputs(p.plan, (p.node, 0.5))


def test_plan_inputs_without_a_mesh_source_reads_no_mesh(impl):
    p = Plan(impl, mesh_source=None, mesh=None)
    assert impl.plan_inputs(p.plan, (p.node, 0.5))[0] == (1.0, 2.0)


def test_plan_write(impl):
    p = Plan(impl)
    assert impl.plan_write(p.plan, p.outputs(None, 5.0)) is True
    assert [box.item for box in p.boxes] == [1.0, 5.0]


@pytest.mark.parametrize("change", ["another trace", "not an array", "no aux", "short output"])
def test_plan_write_refuses_and_writes_nothing(impl, change):
    p = Plan(impl, changed=(0, 1))
    p.replace(targets=p.boxes)
    outputs = {
        "another trace": p.outputs(7.0, 8.0, info=object()),
        "not an array": p.outputs(7.0, [8.0]),  # a container changed in place, or a tracer
        "no aux": (p.outputs(7.0, 8.0)[0], (), "user output", None),
        "short output": p.outputs(7.0),
    }[change]
    assert impl.plan_write(p.plan, outputs) is False
    assert [box.item for box in p.boxes] == [1.0, 2.0]


def test_plan_c_steps_check_the_plan():
    with pytest.raises(TypeError, match="expected a CallPlan, got list"):
        _speedups.plan_inputs([], ())
    p = Plan(_speedups)
    with pytest.raises(TypeError, match="args must be a tuple, not list"):
        _speedups.plan_inputs(p.plan, [p.node, 0.5])
    with pytest.raises(TypeError, match="expected a CallPlan, got CallPlan"):  # the twin's
        _speedups.plan_write(Plan(TWINS["Python"]).plan, p.outputs(None, 1.0))


def test_a_plan_is_made_by_keyword_with_tuples_and_is_read_only(impl):
    p = Plan(impl)
    with pytest.raises(TypeError, match="types must be a tuple, not list"):
        p.replace(types=[Node, float])
    fields = dict(p.fields, types=(Node, float))
    with pytest.raises(TypeError, match="takes its 17 fields by keyword"):
        impl.CallPlan(**{k: v for k, v in fields.items() if k != "entry"})
    with pytest.raises(TypeError):
        impl.CallPlan(*fields.values())
    plan = impl.CallPlan(**fields)
    assert [getattr(plan, name) for name in fields] == list(fields.values())
    with pytest.raises(AttributeError):
        plan.mesh = None


def test_same_structure(impl):
    class Plain:
        pass

    a, b, box = Plain(), Plain(), Box({"tag": 1})
    holders, held = (a, weakref.ref(b)), (vars(a), vars(b))
    metadata = (box.item,)
    args = [holders, held, (a, box), (Plain, Box), SLOT, (box,), metadata, (), ()]
    assert impl.same_structure(*args)
    assert impl.same_structure(*args[:4], None, (), (), (), ())
    box.item = {"tag": 1}  # an equal dict, another object
    assert not impl.same_structure(*args)
    box.item = metadata[0]
    a.__class__ = type("Other", (), {})
    assert not impl.same_structure(*args)
    a.__class__ = Plain
    b.__dict__ = {}
    assert not impl.same_structure(*args)


@pytest.mark.skipif(
    not dict_watch.versions_available(), reason="dict version tags are read on CPython 3.11"
)
def test_dict_versions_move_on_a_change_and_same_structure_compares_them(impl):
    d, e = {"a": 1}, {}
    tags = _speedups.dict_versions((d, e))
    assert _speedups.dict_versions((d, e)) == tags
    assert impl.same_structure((), (), (), (), None, (), (), (d, e), tags)
    d["a"] = 2
    assert _speedups.dict_versions((d, e))[0] != tags[0]
    assert not impl.same_structure((), (), (), (), None, (), (), (d, e), tags)
    with pytest.raises(TypeError, match="expected dicts, got OrderedDict"):
        _speedups.dict_versions((collections.OrderedDict(),))


def test_dict_versions_are_read_by_the_c_extension_only():
    with pytest.raises(NotImplementedError, match="C extension only"):
        speedups._dict_versions(({},))
