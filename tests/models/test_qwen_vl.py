"""Qwen2.5-VL and Qwen3-VL on foveal's runner and engine (families/qwen_vl/model.py), against transformers.

Prompts (testing/tiny_qwen.prompts): chat prompts with images of four sizes, one of them holding two
images, and one text-only prompt, run together; greedy tokens must equal transformers' `generate`
on each prompt alone and logits agree within 1e-4 (fp32). Then the same through the engine, pipelined
and blocking; image-feature cache hits; M-RoPE decode positions; the processor's resolution bounds;
and the folders the loader refuses.
"""

import dataclasses
import json
import shutil

import pytest
import torch

from foveal.engine import EngineConfig
from foveal.engine.models import ModelLoadError
from foveal.families import load
from foveal.families.qwen_vl.model import PLACEHOLDER, POSITIONS
from foveal.testing import parity, tiny, tiny_qwen

FAMILIES = list(tiny_qwen.FAMILIES)
TOLERANCE = 1e-4
MAX_NEW = 8


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return {family: tiny.build(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_matches_transformers(family, qwen):
    loaded = load(qwen[family], device="cpu")
    assert loaded.name == family
    prompts = tiny.family_prompts(loaded)
    grids = [
        tuple(g) for p in prompts if p.prefill for g in p.prefill.image_tensors["image_grid_thw"].tolist()
    ]
    assert len(set(grids)) == 5  # five images, five resized sizes
    assert [p.prefill is None for p in prompts] == [False] * 4 + [True]
    assert prompts[2].prefill.image_tensors["image_grid_thw"].shape[0] == 2
    reference = parity.reference_model(qwen[family])
    ours = parity.greedy(parity.trace_in_launch(loaded.runner), prompts, MAX_NEW, loaded.eos_token_ids)
    worst = 0.0
    for seq, prompt in enumerate(prompts):
        tokens, logits = parity.reference_greedy(reference, prompt, loaded.runner.arch, MAX_NEW)
        assert ours.tokens[seq] == tokens, f"{family} prompt {seq}: greedy tokens differ"
        for a, b in zip(ours.logits[seq], logits, strict=True):
            worst = max(worst, float((a - b).abs().max()))
    assert worst < TOLERANCE, f"{family}: max logit difference {worst:.2e}"
    assert len({tuple(t) for t in ours.tokens}) > 1  # the prompts do lead to different answers
    assert loaded.runner.decode_graphs.graphs  # the decode launches were replays of traced graphs


@pytest.mark.parametrize("family", FAMILIES)
def test_image_positions_fall_behind_token_indices(family, qwen):
    """M-RoPE is really in play: an image prompt's last position is below its index (the rope delta)."""
    loaded = load(qwen[family], device="cpu")
    image_prompt = tiny.family_prompts(loaded)[0]
    positions = image_prompt.prefill.image_tensors[POSITIONS]
    assert positions.shape == (3, len(image_prompt.token_ids))
    assert int(positions.max()) < len(image_prompt.token_ids) - 1
    assert not torch.equal(positions[1], positions[2])  # height and width streams differ over the image


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pipelined", [True, False])
def test_engine_matches_transformers(family, pipelined, qwen):
    loaded = load(qwen[family], device="cpu")
    prompts = tiny.family_prompts(loaded)
    expected = parity.reference_engine_tokens(loaded, qwen[family], prompts, MAX_NEW)
    config = EngineConfig(
        pipelined=pipelined, page_size=4, num_pages=256, max_model_len=256, eos_token_ids=loaded.eos_token_ids
    )
    # then again, with the same text prompt (prefix cache) and the images' features cached by key
    rounds = parity.engine_rounds(loaded.runner, loaded.tokenizer, prompts, config, MAX_NEW)
    cached = rounds.prefix_hit_rate
    assert rounds.first == expected
    assert rounds.again == expected
    # each keyed image is encoded once: the last round reads the image cache or the prefix cache's image pages
    assert loaded.runner.image_cache.stats.misses == 4
    assert cached > 0  # the text-only prompt came from the prefix cache: its decode positions read those rows


def _with_key(prefill, key):
    if prefill is None:
        return None
    return dataclasses.replace(prefill, image_key=key)


def test_min_and_max_pixels_set_the_resolution(qwen):
    big = tiny.images(6)[1].resize((256, 256))
    default = load(qwen["qwen2_5_vl"], device="cpu").processor("look", big)
    small = load(qwen["qwen2_5_vl"], device="cpu", image_options={"max_pixels": 56 * 56}).processor(
        "look", big
    )
    large = load(
        qwen["qwen2_5_vl"],
        device="cpu",
        image_options={"min_pixels": 28 * 28 * 36, "max_pixels": 28 * 28 * 64},
    )
    assert default.prefill.num_image_tokens == 16  # the folder's max_pixels: 28 * 28 * 16
    assert small.prefill.num_image_tokens == 4
    assert large.processor("look", big).prefill.num_image_tokens == 64
    with pytest.raises(ModelLoadError, match="min_pixels=.* exceeds max_pixels"):
        load(qwen["qwen2_5_vl"], device="cpu", image_options={"min_pixels": 10**6, "max_pixels": 10})
    with pytest.raises(ModelLoadError, match="not understood"):
        load(qwen["qwen2_5_vl"], device="cpu", image_options={"fps": 2})
    with pytest.raises(ModelLoadError, match="not supported for llama"):
        load(
            tiny.build("llama", qwen["qwen2_5_vl"].parent / "llama"),
            device="cpu",
            image_options={"max_pixels": 10},
        )


def test_placeholders_must_match_the_images(qwen):
    loaded = load(qwen["qwen3_vl"], device="cpu")
    a, b = tiny.images(2)
    two = loaded.processor(PLACEHOLDER + "x" + PLACEHOLDER, [a, b])
    assert two.prefill.image_tensors["image_grid_thw"].shape[0] == 2
    front = loaded.processor("no placeholder", [a, b])  # placed in front
    assert front.token_ids[: len(two.token_ids) - 2][:1] == two.token_ids[:1]
    with pytest.raises(ValueError, match="2 image placeholders .* for 1 images"):
        loaded.processor(PLACEHOLDER + PLACEHOLDER, a)


def _copy(folder, tmp_path, edit_config=None, edit_processor=None):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    for name, edit in (("config.json", edit_config), ("preprocessor_config.json", edit_processor)):
        if edit is not None:
            data = json.loads((out / name).read_text())
            edit(data)
            (out / name).write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    ("edit_config", "edit_processor", "message"),
    [
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), None, "rope type 'yarn'"),
        (lambda c: c["text_config"]["rope_parameters"].pop("mrope_section"), None, "no mrope_section"),
        (lambda c: c.pop("vision_config"), None, "no vision_config"),
        (lambda c: c.update(image_token_id=None), None, "no image_token_id"),
        (None, lambda p: p.pop("image_processor_type"), "name no image_processor_type"),
    ],
)
def test_unsupported_variants_are_refused_at_load(qwen, tmp_path, edit_config, edit_processor, message):
    folder = _copy(qwen["qwen2_5_vl"], tmp_path, edit_config, edit_processor)
    with pytest.raises(ModelLoadError, match=message):
        load(folder, device="cpu")


def _legacy_layout(config: dict) -> None:
    """config.json as the published Qwen2.5-VL folders write it: text fields at the top level,
    rope_scaling {"type": "mrope", ...}, a sliding_window that use_sliding_window turns off."""
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key, value in text.items():
        if key not in ("architectures", "model_type", "dtype"):
            config.setdefault(key, value)
    config.update(
        rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
        rope_theta=rope["rope_theta"],
        sliding_window=32768,
        use_sliding_window=False,
    )


def test_published_config_layout_loads_and_matches(qwen, tmp_path):
    folder = _copy(qwen["qwen2_5_vl"], tmp_path, _legacy_layout)
    assert "text_config" not in json.loads((folder / "config.json").read_text())
    loaded = load(folder, device="cpu")
    worst, equal = parity.compare(
        loaded, parity.reference_model(qwen["qwen2_5_vl"]), tiny.family_prompts(loaded)
    )
    assert equal and worst < TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_image_features_give_identical_results_without_the_vision_tower(family, qwen):
    """A second call with the same image keys does not run the vision tower (Qwen3-VL: its DeepStack
    maps come back from the cache too) and gives the same logits, bit for bit."""
    loaded = load(qwen[family], device="cpu")
    parity.trace_in_launch(loaded.runner)  # every decode launch a replay in both runs (test_image_cache.py)
    calls = []
    loaded.runner.model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    prompts = [
        type(p)(p.token_ids, _with_key(p.prefill, f"k{i}")) for i, p in enumerate(tiny.family_prompts(loaded))
    ]
    miss = parity.greedy(loaded.runner, prompts, 4)
    assert len(calls) == 1  # the four image prompts' five images in one encoder call
    hit = parity.greedy(loaded.runner, prompts, 4)
    assert len(calls) == 1 and loaded.runner.image_cache.stats.hits == 4
    assert hit.tokens == miss.tokens
    for a, b in zip(hit.logits, miss.logits, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_folder_with_only_a_video_processor_is_refused(qwen, tmp_path):
    folder = _copy(qwen["qwen3_vl"], tmp_path)
    (folder / "preprocessor_config.json").rename(folder / "video_preprocessor_config.json")
    with pytest.raises(ModelLoadError, match=r"no image processor settings \(preprocessor_config.json.*\); save the image processor"):
        load(folder, device="cpu")
