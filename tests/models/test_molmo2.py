"""Molmo 2 on foveal's runner and engine (families/molmo2/), against transformers.

The tiny checkpoint (testing/tiny_molmo2.py) has Molmo's image tokens past the LM head, images in
overlapping crops plus a low-resolution view, and image tokens that attend to each other both ways.
Prompts: images of three sizes (one prompt holds two, with text between them) and a text-only one,
run together; greedy tokens must equal transformers' `generate` on each prompt alone and logits agree
within 1e-4 (fp32), through the runner and the engine (pipelined and blocking, from the prefix and
image caches). Switching the bidirectional image block off in foveal's model must break that. Then
the pointing grammar, the skills and the folders refused at load.
"""

import json
import shutil

import pytest
import safetensors.torch

import foveal
from foveal import grammars
from foveal.engine import EngineConfig
from foveal.engine.models import ModelLoadError
from foveal.families import load
from foveal.families.base import UnsupportedSkill
from foveal.families.molmo2.answers import MolmoPointsSpec
from foveal.testing import parity, tiny_molmo2

TOLERANCE = 1e-4
MAX_NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_molmo2.build_molmo2(tmp_path_factory.mktemp("molmo2") / "tiny")


@pytest.fixture(scope="module")
def expected(folder):
    """transformers' greedy tokens and per-step logits of each test prompt, run alone (computed once)."""
    family = load(folder, device="cpu")
    reference = parity.reference_model(folder)
    return [parity.reference_greedy(reference, p, family.runner.arch, MAX_NEW) for p in tiny_molmo2.prompts(family)]


def _worst(family, expected, runner=None, steps=MAX_NEW):
    ours = parity.greedy(runner or family.runner, tiny_molmo2.prompts(family), steps, family.eos_token_ids)
    return (*parity.against(ours, expected, steps), ours)  # the image tokens' columns past the head: -inf


def test_runner_matches_transformers(folder, expected):
    family = load(folder, device="cpu")
    assert family.name == "molmo2"
    prompts = tiny_molmo2.prompts(family)
    assert [p.prefill is None for p in prompts] == [False, False, True]
    assert prompts[1].prefill.image_tensors["image_grids"].shape[0] == 2
    assert len(family.tokenizer) > family.runner.head_size  # image tokens lie past the LM head
    worst, equal, ours = _worst(family, expected, parity.trace_in_launch(family.runner))
    assert equal, "greedy tokens differ from transformers'"
    assert worst < TOLERANCE, f"max logit difference {worst:.2e}"
    assert len({tuple(t) for t in ours.tokens}) > 1
    assert family.runner.decode_graphs.graphs


def test_causal_image_tokens_break_parity(folder, expected, monkeypatch):
    """The parity above depends on the image tokens seeing each other both ways."""
    family = load(folder, device="cpu")
    monkeypatch.setattr(family.runner, "attention_blocks", lambda batch: None)
    worst, _, _ = _worst(family, expected, steps=1)
    assert worst > 100 * TOLERANCE, f"causal image tokens still matched ({worst:.2e})"


@pytest.mark.parametrize("pipelined", [True, False])
def test_engine_matches_transformers(pipelined, folder, expected):
    family = load(folder, device="cpu")
    prompts = tiny_molmo2.prompts(family)
    expected = [[t for t in tokens if t not in family.eos_token_ids] for tokens, _ in expected]
    config = EngineConfig(
        pipelined=pipelined, page_size=4, num_pages=256, max_model_len=256, eos_token_ids=family.eos_token_ids
    )
    rounds = parity.engine_rounds(family.runner, family.tokenizer, prompts, config, MAX_NEW)
    cached = rounds.prefix_hit_rate
    assert rounds.first == expected
    assert rounds.again == expected  # from the prefix cache's pages and the image cache
    assert family.runner.image_cache.stats.misses == 2
    assert cached > 0


def test_pages_are_shared_only_up_to_the_same_last_image(folder):
    """An image token's K/V depends on every image token of its prompt, so the prefix seed covers the
    prompt through its last image token."""
    family = load(folder, device="cpu")
    two = tiny_molmo2.prompts(family)[1]
    last = max(i for i, t in enumerate(two.token_ids) if t in family.processor.block_ids)
    assert two.prefill.prefix_len == last + 1


def test_the_points_grammar_keeps_points_inside_the_image(folder):
    family = load(folder, device="cpu")
    spec = MolmoPointsSpec("points", max_objects=3, label="red circle")
    automaton = grammars.compile(spec, family.tokenizer, vocab_size=family.runner.vocab_size)

    def accepts(text: str) -> bool:
        matcher = automaton.matcher()
        try:
            for token in family.tokenizer.encode(text, add_special_tokens=False):
                matcher.commit(token)
        except Exception:
            return False
        return True

    good = '<points coords="1 1 073 160 2 1000 000">red circle</points>'
    assert accepts(good) and accepts("There are none.")
    assert not accepts('<points coords="1 1 073 1001">red circle</points>')  # past the image's edge
    assert not accepts('<points coords="1 2 073 160">red circle</points>')  # indices start at 1
    assert not accepts('<points coords="1 1 1 1 2 2 2 3 3 3 4 4 4">red circle</points>')
    assert spec.parse_answer(good) == {"points": [{"x": 0.073, "y": 0.16}, {"x": 1.0, "y": 0.0}]}
    assert spec.parse_answer("There are none.") == {"points": []}


def test_point_returns_normalized_points_and_detect_names_point(folder):
    with foveal.load(folder, device="cpu", max_batch_size=4, max_model_len=256) as model:
        image = tiny_molmo2.pictures()[0]
        points = model.point(image, "red circle", settings={"max_objects": 3})["points"]
        assert len(points) <= 3
        for point in points:
            assert 0 <= point["x"] <= 1 and 0 <= point["y"] <= 1 and 0 <= point["score"] <= 1
        with pytest.raises(UnsupportedSkill, match="use point"):
            model.detect(image, "red circle")


def _copy(folder, tmp_path):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize("missing", ["vision_config", "adapter_config", "image_patch_id"])
def test_a_config_without_its_vision_parts_is_refused(folder, tmp_path, missing):
    out = _copy(folder, tmp_path)
    data = json.loads((out / "config.json").read_text())
    data.pop(missing)
    (out / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=missing):
        load(out, device="cpu")


def test_a_folder_without_its_image_processor_is_refused(folder, tmp_path):
    out = _copy(folder, tmp_path)
    (out / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no image processor settings \(preprocessor_config.json, or processor_config.json"):
        load(out, device="cpu")


def test_a_folder_missing_a_tensor_is_refused_naming_it(folder, tmp_path):
    out = _copy(folder, tmp_path)
    weights = safetensors.torch.load_file(out / "model.safetensors")
    name = next(k for k in weights if "image_pooling_2d" in k)
    del weights[name]
    safetensors.torch.save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="image_pooling_2d"):
        load(out, device="cpu")
