"""Free text never holds a family's reserved tokens (families/reserved.py): PaliGemma's and the embedded
model's location and segmentation tokens are masked outside detect and point."""

import pytest
import torch

import foveal
from foveal.families.reserved import PALIGEMMA_RESERVED, ReservedMask, reserved_ids
from foveal.vision import scenes


@pytest.fixture(scope="module")
def model():
    with foveal.load(device="cpu") as loaded:
        yield loaded


def _allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_the_mask_row_clears_exactly_the_reserved_bits():
    ids = [0, 31, 32, 63, 64, 99]
    row = ReservedMask(100, ids).row
    assert row.dtype == torch.int32 and row.shape == (4,)
    assert [t for t in range(100) if not _allowed(row, t)] == ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ReservedMask(100, [100])


def test_paligemma_families_reserve_their_location_and_segmentation_tokens(model):
    tokenizer = model.family.tokenizer
    ids = model.family.reserved_token_ids
    texts = {tokenizer.convert_ids_to_tokens(i) for i in ids}
    assert len(ids) == 1024 + 128 and all(PALIGEMMA_RESERVED.fullmatch(t) for t in texts)
    assert reserved_ids(tokenizer, PALIGEMMA_RESERVED) == ids
    detect = model.detect(scenes.render(scenes.generate_scene(3, width=160)), "shape")
    assert detect["objects"]  # the spatial answers still write them


@pytest.mark.parametrize("settings", [None, {"temperature": 1.0, "seed": 7}])
def test_free_text_answers_hold_no_location_tokens(model, settings):
    """On today's 12 scenes, 8 of 36 answers began with <locNNNN> tokens before the mask."""
    answers = []
    for seed in range(12):
        image = scenes.render(scenes.generate_scene(seed, width=160))
        for question in ("describe the shapes", "what is here?", "list the objects"):
            answers.append(model.query(image, question, settings=settings)["answer"])
        answers.append(model.caption(image, settings=settings)["caption"])
    assert not [a for a in answers if "<loc" in a or "<seg" in a]


def test_the_mask_changes_no_answer_that_never_needed_it(model, monkeypatch):
    image = scenes.render(scenes.generate_scene(5, width=160))
    asks = [("caption", "short"), ("query", "how many circles?"), ("query", "what color is the square?")]
    masked = [model.caption(image, length=a)["caption"] if k == "caption" else model.query(image, a)["answer"] for k, a in asks]
    monkeypatch.setattr(type(model.family), "free_text_matcher", lambda self: None)
    plain = [model.caption(image, length=a)["caption"] if k == "caption" else model.query(image, a)["answer"] for k, a in asks]
    assert all("<loc" not in p for p in plain)
    assert masked == plain
