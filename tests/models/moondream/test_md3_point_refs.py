"""Moondream 3's point with spatial references, on the moondream3-tiny fixture's weights.

The preview's HF code (the fixture's reference) has no such call, so nothing is recorded; the layout is
Moondream's engine's (kestrel's point skill): point.prefix + each ref's coord (and size) values + the
object's ids (with the leading space) + point.suffix, decoded as point is. Checked here: the prompt's
layout, the SDK's answer against a one-sequence loop over that prompt on the loaded runner (the point
loop the fixture's recorded point calls are checked with, test_md3_parity.py), pipelined and blocking,
that the refs reach the model, and that Moondream 2 refuses the option.
"""

from __future__ import annotations

import pytest

import foveal
from foveal.families.base import UnsupportedSkill
from foveal.families.moondream.answers import COORD
from foveal.families.moondream.processor import Coord, Size

from .md3 import IMAGES
from .test_md3_parity import COORD_ID, EOS, prefill, x_of

OBJECT, OBJECT_IDS = "tok1011 tok77", [1011, 77]  # the fixture's object: " tok1011 tok77" -> [1011, 77]
REFS = {
    "point": [[0.25, 0.75]],
    "box": [[0.1, 0.2, 0.6, 0.7]],
    "point_and_box": [[0.8, 0.3], [0.15, 0.35, 0.45, 0.9]],
}
MAX_OBJECTS = 3


@pytest.fixture(scope="module", params=[True, False], ids=["pipelined", "blocking"])
def model(request, md3_dir):
    with foveal.load(md3_dir, pipelined=request.param) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def oracle(md3_dir):
    """A second load whose runner the one-sequence loop drives on a private page pool."""
    with foveal.load(md3_dir, pipelined=False) as loaded:
        loaded.family.runner.allocate_kv(128, 16)
        yield loaded.family.runner


def ref_values(refs):
    parts: list = []
    for r in refs:
        if len(r) == 2:
            parts += [Coord(r[0]), Coord(r[1])]
        else:
            parts += [Coord((r[0] + r[2]) / 2), Coord((r[1] + r[3]) / 2), Size(r[2] - r[0], r[3] - r[1])]
    return parts


def point_loop(runner, md3_dir, name, parts):
    """The preview's point loop over a prompt (as test_md3_parity's): the first gate the full argmax,
    later gates on the [coord, eos] rows; x and y from the region head. Returns (points, first logits)."""
    driver, logits, hidden = prefill(runner, md3_dir, name, parts)
    first = logits.clone()
    points = []
    for k in range(MAX_OBJECTS):
        if k == 0 and int(logits.argmax()) == EOS:
            break
        if k > 0 and logits[EOS] > logits[COORD_ID]:
            break
        x = x_of(runner, hidden)
        logits, hidden = driver.run([x])
        y = driver.sample(logits, hidden, COORD)
        logits, hidden = driver.run([y])
        points.append({"x": (x - runner.vocab_size) / 1024, "y": (y - runner.vocab_size) / 1024})
    return points, first


def unscored(points):
    assert all(0.0 <= p["score"] <= 1.0 for p in points)
    return [{"x": p["x"], "y": p["y"]} for p in points]


def test_the_prompt_layout(model):
    family = model.family
    template = family.templates["point"]
    task = family.spatial_point(OBJECT, MAX_OBJECTS, tuple(tuple(r) for r in REFS["point_and_box"]))
    assert task.prompt.prefix == (*template["prefix"], *ref_values(REFS["point_and_box"]))
    assert task.prompt.text == " " + OBJECT and task.prompt.suffix == tuple(template["suffix"])
    assert task.skill == "point" and task.spec == family.point(OBJECT, MAX_OBJECTS).spec
    assert "point" in family.capabilities.spatial_refs


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("case", list(REFS))
def test_point_with_refs_is_the_point_loop_over_that_prompt(model, oracle, md3_dir, name, case):
    template = model.family.templates["point"]
    parts = [*template["prefix"], *ref_values(REFS[case]), *OBJECT_IDS, *template["suffix"]]
    want, with_refs = point_loop(oracle, md3_dir, name, parts)
    image = md3_dir / "images" / f"{name}.png"
    got = model.point(image, OBJECT, settings={"max_objects": MAX_OBJECTS}, spatial_refs=REFS[case])["points"]
    assert unscored(got) == want
    # the refs reach the model: the prompt's last logits differ from point's without them, and so do
    # the scores the engine read from the region heads (the random weights point at the same bins)
    _, without = point_loop(oracle, md3_dir, name, [*template["prefix"], *OBJECT_IDS, *template["suffix"]])
    assert float((with_refs - without).abs().max()) > 1e-3
    plain = model.point(image, OBJECT, settings={"max_objects": MAX_OBJECTS})["points"]
    assert [p["score"] for p in got] != [p["score"] for p in plain]


def test_calls_with_and_without_refs_share_the_image(model, md3_dir):
    """Region values salt the prompt's pages: a plain point after a point with refs on the same image
    answers as a plain point did before it."""
    image = md3_dir / "images" / f"{IMAGES[0]}.png"
    plain = model.point(image, OBJECT)["points"]
    model.point(image, OBJECT, spatial_refs=REFS["box"])
    assert model.point(image, OBJECT)["points"] == plain


def test_moondream_2_refuses_it(shared_dir):
    folder = shared_dir / "fixtures" / "moondream2-tiny"
    if not folder.is_dir():
        pytest.skip(f"the Moondream fixture is absent: {folder}")
    refused = pytest.raises(UnsupportedSkill, match="does not support spatial_refs on point; it takes them on query")
    with foveal.load(folder) as md2, refused:
        md2.point(folder / "images" / "small_64x64.png", "tok1011", spatial_refs=[[0.5, 0.5]])


def test_bad_refs_are_refused(model, md3_dir):
    image = md3_dir / "images" / f"{IMAGES[0]}.png"
    with pytest.raises(ValueError, match="x1 > x2"):
        model.point(image, OBJECT, spatial_refs=[[0.6, 0.5, 0.4, 0.7]])
    with pytest.raises(ValueError, match="neither a point"):
        model.point(image, OBJECT, spatial_refs=[[0.5]])
