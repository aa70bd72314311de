"""Moondream 3's segment on the moondream3-tiny fixture's weights (families/moondream/segment.py): the
fixture cannot record segmentation (its reference has none), so these check the documented semantics
for shape, validity and determinism, not figures.

The fixture's stand-in tokenizer spells every id as `tokN`, which is no path piece, so the tests use a
folder with the same weights and config (no segment template: the documented one is used, mapped as the
fixture maps its templates) and a tokenizer in which some ids > 20 are path pieces, decoded with a
`Fuse` decoder: token texts are concatenated without spaces, as a byte-level tokenizer's are, so the
answer's text loses token boundaries ("12" + "3" reads "123") and only a reading by token pieces
gives the path the tokens spell.
"""

from __future__ import annotations

import json
import shutil

import pytest

import foveal
from foveal.families.base import UnsupportedSkill
from foveal.families.moondream.family3 import (
    REAL_TEMPLATES,
    SEGMENT_TEMPLATE,
    region_values,
    segment_template,
)
from foveal.families.moondream.region import coord_id, size_id
from foveal.families.moondream.segment import SegmentMatcher, value_of_ids
from foveal.families.moondream.svg import bbox_from_region
from foveal.families.moondream.tokenizer import spell
from foveal.vision.svg import check_inside, parse_path

from .md3 import IMAGES, figures

OBJECT = "tok1011 tok77"
BUDGET = {"max_tokens": 40}
# ids > 20 renamed to path pieces: commands, one piece with two items, integers on the 960 viewbox
WORDS = {21: "M", 22: "L", 23: "C", 24: "Z", 25: "Q", 26: "L480"}
WORDS.update({i: str((i * 37) % 961) for i in range(27, 120)})
WORDS.update({120: "1", 121: "2", 122: "12", 123: "3"})
VOCAB, EOS = 1024, 0


def path_folder(md3_dir, factory, fuse=True):
    folder = factory.mktemp("moondream3-paths")
    raw = json.loads((md3_dir / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    name_of = {i: word for word, i in vocab.items()}
    for i, word in WORDS.items():
        del vocab[name_of[i]]
        vocab[word] = i
    if fuse:
        raw["decoder"] = {"type": "Fuse"}
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    shutil.copy(md3_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(md3_dir / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def folder(md3_dir, tmp_path_factory):
    return path_folder(md3_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def models(folder):
    loaded = {mode: foveal.load(folder, pipelined=mode == "pipelined") for mode in ("pipelined", "blocking")}
    yield loaded
    for model in loaded.values():
        model.close()


def image(md3_dir, name):
    return md3_dir / "images" / f"{name}.png"


def test_segment_answers_a_path_and_the_box_of_the_first_region_values(models, md3_dir):
    model = models["pipelined"]
    assert "segment" in model.family.capabilities.skills and "segment" in model.family.capabilities.spatial_refs
    for name in IMAGES:
        result = model.segment(image(md3_dir, name), OBJECT, settings=BUDGET)
        assert set(result) == {"path", "bbox"}
        segments = check_inside(result["path"])  # parses, not empty, every point in the image
        assert segments[0].command == "M"
        assert all(0.0 <= v <= 1.0 for v in result["bbox"].values())
        # on these random weights the heads give the recorded detect's first box for this prompt too
        x_min, y_min, x_max, y_max = figures(md3_dir)["images"][name]["detect"]["result"][0].values()
        want = {"x_min": x_min, "y_min": y_min, "x_max": x_max, "y_max": y_max}
        assert result["bbox"] == pytest.approx({k: min(1.0, max(0.0, v)) for k, v in want.items()}, abs=1e-9)
        assert result.usage.completion_tokens <= BUDGET["max_tokens"]


def test_segment_is_deterministic_pipelined_and_blocking(models, md3_dir):
    for name in IMAGES:
        answers = [models[mode].segment(image(md3_dir, name), OBJECT, settings=BUDGET) for mode in models for _ in (0, 1)]
        assert all(dict(a) == dict(answers[0]) for a in answers), name


def test_the_stream_sends_the_box_first_then_chunks_that_join_to_the_path(models, md3_dir):
    for mode, model in models.items():
        want = model.segment(image(md3_dir, "tall_90x160"), OBJECT, settings=BUDGET)
        stream = model.segment(image(md3_dir, "tall_90x160"), OBJECT, stream=True, settings=BUDGET)
        updates = list(stream)
        assert updates[0] == {"bbox": want["bbox"]}, mode
        chunks = [u["chunk"] for u in updates[1:-1]]
        assert len(chunks) > 1 and "".join(chunks) == want["path"]
        assert updates[-1] == {"path": want["path"], "bbox": want["bbox"], "completed": True}
        assert dict(stream.result) == dict(want)


def test_spatial_refs_go_into_the_prompt(models, md3_dir):
    model = models["blocking"]
    plain = model.segment(image(md3_dir, "shapes_320x240"), OBJECT, settings=BUDGET)
    refs = model.segment(image(md3_dir, "shapes_320x240"), OBJECT, spatial_refs=[[0.2, 0.3, 0.6, 0.9]], settings=BUDGET)
    check_inside(refs["path"])
    assert refs.usage.prompt_tokens == plain.usage.prompt_tokens + 3  # coord, coord, size


def test_the_path_is_read_by_token_pieces_not_from_the_text(models):
    """"12" then "3" are two integers; the Fuse decoder's text reads "M123"."""
    family = models["blocking"].family
    tokens = family.path_tokens()
    regions = [coord_id(VOCAB, 512), coord_id(VOCAB, 256), size_id(VOCAB, 900, 800)]
    ids = [*regions, 21, 122, 123, 26, 120, 24]  # M 12 3 L 480 1 Z
    assert family.tokenizer.decode(ids[3:]) == "M123L4801Z"
    value = value_of_ids(tokens, ids)
    assert value["path"] == "M 0.013 0.003 L 0.5 0.001 Z"
    spelled = family.tokenizer.decode(regions, skip_special_tokens=False)
    assert spelled == "".join(spell(VOCAB, i) for i in regions)
    (_, (x,)), (_, (y,)), (_, (w, h)) = region_values(spelled)
    assert value["bbox"] == bbox_from_region(x, y, w, h)


def test_the_matcher_keeps_the_path_valid(models):
    tokens = models["blocking"].family.path_tokens()
    matcher = SegmentMatcher(tokens)
    with pytest.raises(ValueError, match="coord"):
        matcher.commit(coord_id(VOCAB, 0) + 1024)  # a size where x's coordinate is due
    for value in (coord_id(VOCAB, 1), coord_id(VOCAB, 2), size_id(VOCAB, 3, 4)):
        matcher.commit(value)
    assert matcher.step_kind() == 0 and matcher.value(final=False)["path"] == ""
    allowed = set(tokens.at(matcher.state)[0])
    assert allowed == {i for i, items in tokens.items.items() if items[0] in "Mm"}  # a move first; no eos
    for bad in (EOS, 22, 27, 500):  # eos before any path, a line, a number, a token that is no path piece
        with pytest.raises(ValueError):
            matcher.commit(bad)
    matcher.commit(21)
    matcher.commit(27)
    assert EOS not in tokens.at(matcher.state)[0]  # M takes two numbers
    assert 21 not in tokens.at(matcher.state)[0]  # no command before they are given
    matcher.commit(28)
    assert EOS in tokens.at(matcher.state)[0]
    assert matcher.value(final=False)["path"] == matcher.value(final=True)["path"] == "M 0.04 0.078"
    parse_path(matcher.value(final=True)["path"])
    matcher.commit(EOS)
    assert matcher.is_terminated()
    matcher.rollback(2)
    assert not matcher.is_terminated() and matcher.items == ["M", WORDS[27]] and matcher.settled == 0


def test_an_answer_cut_by_max_tokens_keeps_its_complete_groups(models):
    tokens = models["blocking"].family.path_tokens()
    regions = [coord_id(VOCAB, 512), coord_id(VOCAB, 256), size_id(VOCAB, 900, 800)]
    assert value_of_ids(tokens, [*regions, 21, 120, 121, 22, 120])["path"] == "M 0.001 0.002"
    with pytest.raises(ValueError, match="max_tokens"):
        value_of_ids(tokens, [*regions, 21, 120])


def test_the_template_is_the_checkpoints_or_the_documented_one(md3_dir):
    templates = figures(md3_dir)["config"]["tokenizer"]["templates"]
    assert segment_template(templates, VOCAB) == {"prefix": [1, 17374 % VOCAB, 2], "suffix": [3]}
    assert segment_template(REAL_TEMPLATES, 51200) == SEGMENT_TEMPLATE
    own = {**templates, "segment": {"prefix": [1, 5, 2], "suffix": [3]}}
    assert segment_template(own, VOCAB) == own["segment"]
    assert segment_template({"query": {"prefix": [1, 2, 2], "suffix": [3]}}, VOCAB) is None


def test_the_fixture_tokenizer_cannot_spell_a_path(md3_dir):
    model = foveal.load(md3_dir, pipelined=False)
    try:
        with pytest.raises(UnsupportedSkill, match="SVG path"):
            model.segment(image(md3_dir, "tall_90x160"), OBJECT)
    finally:
        model.close()


def test_segment_through_the_server_and_the_moondream_client(models, md3_dir):
    moondream = pytest.importorskip("moondream", reason="the moondream client is installed by .ci/run (--no-deps)")
    from PIL import Image

    from foveal.server import create_app
    from foveal.server.background import BackgroundServer

    model = models["pipelined"]
    picture = Image.open(image(md3_dir, "shapes_320x240")).convert("RGB")
    with BackgroundServer(create_app(model)) as url:
        client = moondream.vl(endpoint=f"{url}/v1")
        got = client.segment(picture, OBJECT, settings=BUDGET)
        updates = list(client.segment(picture, OBJECT, stream=True, settings=BUDGET))
    check_inside(got["path"])
    assert updates[0] == {"bbox": got["bbox"]}
    assert "".join(u["chunk"] for u in updates[1:-1]) == got["path"]
    assert updates[-1]["path"] == got["path"] and updates[-1]["completed"] is True
