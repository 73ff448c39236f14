"""`Explanation.layout` / `.show`: which devices hold which block of a parameter.

Checked against JAX's own placement: the blocks and device ids of the picture are those of
the array that `jax.device_put` makes with the same `NamedSharding`.
"""

import io
from xml.etree import ElementTree

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

import meshlift as ml

SHAPES = {
    "w2": (16, 32),
    "w1": (24,),
    "w3": (8, 12, 16),
    "scalar": (),
}


def tree():
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in SHAPES.items()}


PLAN = ml.StateSharding(
    {
        ml.path_endswith("w2"): P("data", "model"),
        ml.path_endswith("w1"): P(("data", "model")),
        ml.path_endswith("w3"): P(None, "model", None),
        ...: P(),
    }
)


@pytest.fixture(scope="module")
def mesh():
    return ml.make_mesh({"data": 2, "model": 4})


def placed(mesh, spec, shape):
    """{block bounds: device ids} of a real array placed by JAX."""
    array = jax.device_put(jnp.zeros(shape), NamedSharding(mesh, spec))
    found: dict = {}
    for shard in array.addressable_shards:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(shard.index, shape, strict=True))
        found.setdefault(bounds, []).append(shard.device.id)
    return {bounds: tuple(sorted(ids)) for bounds, ids in found.items()}


@pytest.mark.parametrize("path", list(SHAPES))
def test_blocks_are_where_jax_puts_them(mesh, path):
    layout = ml.explain(tree(), PLAN, mesh).layout(path)
    spec = {r.path: r.spec for r in ml.explain(tree(), PLAN, mesh).rows}[path]
    assert {b.index: b.devices for b in layout.blocks} == placed(mesh, spec, SHAPES[path])


def test_two_dimensional_grid_rows_then_columns(mesh):
    layout = ml.explain(tree(), PLAN, mesh).layout("w2")
    assert layout.dims == (0, 1)
    assert layout.grid() == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    text = str(layout)
    assert "w2 (16, 32) float32, P('data', 'model') on mesh data=2, model=4" in text
    assert "8 blocks of (8, 8), each on 1 device(s)" in text
    for device in range(8):
        assert f"CPU {device} " in text


def test_one_dimensional_is_a_row_and_replicated_is_one_block(mesh):
    report = ml.explain(tree(), PLAN, mesh)
    assert report.layout("w1").grid() == [[str(d) for d in range(8)]]
    assert report.layout("scalar").grid() == [["0,1,2,3,4,5,6,7"]]
    assert "one block, replicated on all 8 devices" in str(report.layout("scalar"))


def test_higher_rank_draws_the_split_dimension(mesh):
    layout = ml.explain(tree(), PLAN, mesh).layout("w3")
    assert layout.dims == (0, 1)  # dimension 1 is split; dimension 0 fills the picture
    assert layout.grid() == [["0,4", "1,5", "2,6", "3,7"]]
    assert (
        "columns: dimension 1 (12) split over 'model' (4); rows: dimension 0 (8) not split; "
        "replicated over 'data' (2)"
    ) in str(layout)


def test_a_mesh_given_as_sizes_uses_the_first_devices_as_make_mesh_does(mesh):
    by_sizes = ml.explain(tree(), PLAN, {"data": 2, "model": 4}).layout("w2")
    by_mesh = ml.explain(tree(), PLAN, mesh).layout("w2")
    assert by_sizes.blocks == by_mesh.blocks


def test_the_mesh_in_context_is_the_one_drawn():
    mesh = ml.make_mesh({"data": 2, "model": 4}, devices=jax.devices()[::-1])
    with ml.use_mesh(mesh):
        layout = ml.explain(tree(), PLAN).layout("w2")
    assert layout.grid() == [["7", "6", "5", "4"], ["3", "2", "1", "0"]]


def test_a_unique_last_part_of_a_path_is_enough():
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    plan = ml.StateSharding({ml.path_endswith("kernel"): P(None, "model"), ...: P()})
    report = ml.explain(model, plan, {"data": 2, "model": 4})
    assert report.layout("kernel").path == "kernel"
    assert report.layout("kernel").grid() == [["0,4", "1,5", "2,6", "3,7"]]


def test_unknown_path_names_the_nearest(mesh):
    report = ml.explain(tree(), PLAN, mesh)
    with pytest.raises(LookupError, match=r"^no parameter 'w22' on this plan; did you mean w2"):
        report.layout("w22")
    with pytest.raises(LookupError, match=r"; its paths are scalar, w1, w2, w3$"):
        report.layout("zzzzzz")


def test_a_spec_that_does_not_fit_is_not_drawn():
    bad = ml.StateSharding({ml.path_endswith("w1"): P("unknown"), ...: P()})
    report = ml.explain(tree(), bad, {"data": 2, "model": 4})
    with pytest.raises(ml.PlanError, match=r"cannot draw `w1`: mesh axis 'unknown'"):
        report.layout("w1")


def test_too_few_devices_says_how_to_get_more():
    report = ml.explain(tree(), PLAN, {"data": 4, "model": 8})
    with pytest.raises(ValueError, match=r"needs 32 devices.*device_count=32"):
        report.layout("w2")


def test_show_prints_each_picture_and_folds_in_a_narrow_console(mesh):
    out = io.StringIO()
    report = ml.explain(tree(), PLAN, mesh)
    report.show("w2", "w1", console=Console(file=out, width=40, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 40
    assert text.index("w2 (16, 32)") < text.index("w1 (24,)")


def test_layout_to_dict_is_plain_data(mesh):
    data = ml.explain(tree(), PLAN, mesh).layout("w3").to_dict()
    assert data["spec"] == [None, "model", None]
    assert data["platform"] == "cpu"
    assert data["blocks"][0] == {"index": [[0, 8], [0, 3], [0, 16]], "devices": [0, 4]}


def test_explanations_compare_as_before_whatever_the_mesh(mesh):
    assert ml.explain(tree(), PLAN, mesh) == ml.explain(tree(), PLAN, {"data": 2, "model": 4})


def svg_texts(layout) -> tuple[list[str], list[str]]:
    """The block labels (texts centred in a rect) and the other texts of the SVG picture."""
    root = ElementTree.fromstring(layout.svg())
    namespace = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{namespace}svg"
    texts = [t.text for t in root.iter(f"{namespace}text")]
    labels = [t.text for t in root.iter(f"{namespace}text") if t.get("text-anchor") == "middle"]
    assert len(list(root.iter(f"{namespace}rect"))) == len(labels)
    return labels, [t for t in texts if t not in labels]


def test_svg_draws_the_grid_with_its_mesh_axes(mesh):
    layout = ml.explain(tree(), PLAN, mesh).layout("w2")
    labels, notes = svg_texts(layout)
    assert labels == [label for row in layout.grid() for label in row]
    assert notes == [
        "w2 (16, 32) float32, P('data', 'model') on mesh data=2, model=4",
        "columns: dimension 1 (32) split over 'model' (4)",
        "8 blocks of (8, 8), each on 1 device(s); labels: device ids",
        "rows: dimension 0 (16) split over 'data' (2)",
    ]


def test_svg_says_which_mesh_axes_replicate(mesh):
    labels, notes = svg_texts(ml.explain(tree(), PLAN, mesh).layout("w3"))
    assert labels == ["0,4", "1,5", "2,6", "3,7"]
    assert notes[-1] == "replicated over 'data' (2)"
    labels, notes = svg_texts(ml.explain(tree(), PLAN, mesh).layout("scalar"))
    assert labels == ["0,1,2,3,4,5,6,7"]
    assert notes[-1] == "one block, replicated on all 8 devices; labels: device ids"
