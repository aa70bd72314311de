"""Gemma 4 on foveal's runner and engine (families/gemma4/), against transformers.

The tiny checkpoint (testing/tiny_gemma4.py) has sliding layers with a window shorter than every
prompt, full layers of another head size and KV head count, per-layer input embeddings and two
KV-sharing layers. Prompts: images of three sizes (one prompt holds two) and a text-only one, run
together; greedy tokens must equal transformers' `generate` on each prompt alone and logits agree
within 1e-4 (fp32), through the runner and through the engine (pipelined and blocking, from the
prefix and image caches). Each special part, switched off in foveal's model only, must break that.
"""

import json
import shutil

import pytest
import safetensors.torch
import torch

import foveal
from foveal.engine import EngineConfig
from foveal.engine.kv_cache import pages_needed
from foveal.engine.models import ModelLoadError
from foveal.engine.models.attention import PagedContext
from foveal.engine.sliding import SlidingPages
from foveal.families import load
from foveal.testing import parity, tiny_gemma4

TOLERANCE = 1e-4
MAX_NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_gemma4.build_gemma4(tmp_path_factory.mktemp("gemma4") / "tiny")


@pytest.fixture(scope="module")
def expected(folder):
    """transformers' greedy tokens and per-step logits of each test prompt, run alone (computed once)."""
    family = load(folder, device="cpu")
    reference = parity.reference_model(folder)
    return [parity.reference_greedy(reference, p, family.runner.arch, MAX_NEW) for p in tiny_gemma4.prompts(family)]


def _worst(family, expected, runner=None, steps=MAX_NEW):
    """(max |logit difference|, tokens equal) of foveal's runner vs transformers over `steps` steps."""
    ours = parity.greedy(runner or family.runner, tiny_gemma4.prompts(family), steps, family.eos_token_ids)
    return (*parity.against(ours, expected, steps), ours)


def test_runner_matches_transformers(folder, expected):
    family = load(folder, device="cpu")
    assert family.name == "gemma4"
    prompts = tiny_gemma4.prompts(family)
    assert [p.prefill is None for p in prompts] == [False, False, True]
    sizes = [p.prefill.image_tensors["image_position_ids"].shape[0] for p in prompts if p.prefill]
    assert sizes == [1, 2]  # the second prompt carries two images
    assert min(len(p.token_ids) for p in prompts) > tiny_gemma4.WINDOW  # the window is in play
    worst, equal, ours = _worst(family, expected, parity.trace_in_launch(family.runner))
    assert equal, "greedy tokens differ from transformers'"
    assert worst < TOLERANCE, f"max logit difference {worst:.2e}"
    assert len({tuple(t) for t in ours.tokens}) > 1
    assert family.runner.decode_graphs.graphs  # decode launches were replays of traced graphs


def test_kv_layout_follows_the_layer_kinds(folder):
    """Sliding and full layers own tensors of their own shapes; the two sharing layers read the last
    earlier layer of their kind and own none."""
    family = load(folder, device="cpu")
    layout = family.runner.kv_layout
    assert layout.shapes == ((2, 16), (1, 32), (2, 16))
    assert layout.index == (0, 1, 2, 2, 1) and layout.shared == (False, False, False, True, True)
    assert family.runner.kv_bytes_per_token() == 2 * (2 * 16 + 32 + 2 * 16) * 4


def _break_window(monkeypatch):
    monkeypatch.setattr(PagedContext, "mask_for", lambda self, window: self.mask)


def _break_per_layer_inputs(family, monkeypatch):
    for layer in family.runner.model.model.language_model.layers:
        monkeypatch.setattr(layer, "hidden_size_per_layer_input", 0)


def _break_kv_sharing(family, monkeypatch):
    sharing = family.runner.model.model.language_model.layers[3]  # sliding; its producer is layer 2
    monkeypatch.setattr(sharing.self_attn, "foveal_kv_index", 0)  # layer 0's K/V: another sliding layer's


@pytest.mark.parametrize("part", ["sliding window", "per-layer embeddings", "kv sharing"])
def test_switching_a_special_part_off_breaks_parity(part, folder, expected, monkeypatch):
    """The parity above depends on each special part: without it (in foveal's model only) logits move
    (the prompts' own logits and the next step's: every prompt is longer than the window)."""
    family = load(folder, device="cpu")
    if part == "sliding window":
        _break_window(monkeypatch)
    elif part == "per-layer embeddings":
        _break_per_layer_inputs(family, monkeypatch)
    else:
        _break_kv_sharing(family, monkeypatch)
    worst, _, _ = _worst(family, expected, steps=2)
    assert worst > 100 * TOLERANCE, f"{part} off still matched ({worst:.2e})"


@pytest.mark.parametrize("pipelined", [True, False])
def test_engine_matches_transformers(pipelined, folder, expected):
    family = load(folder, device="cpu")
    prompts = tiny_gemma4.prompts(family)
    expected = [[t for t in tokens if t not in family.eos_token_ids] for tokens, _ in expected]
    config = EngineConfig(
        pipelined=pipelined, page_size=4, num_pages=256, max_model_len=256, eos_token_ids=family.eos_token_ids
    )
    rounds = parity.engine_rounds(family.runner, family.tokenizer, prompts, config, MAX_NEW)
    assert family.runner.kv.sliding  # the sliding layers' pages are a pool of their own (engine/sliding.py)
    assert rounds.first == expected
    assert rounds.again == expected  # from the prefix cache's pages (both pools') and the image cache
    assert family.runner.image_cache.stats.misses == 2  # each keyed prompt's images encoded once
    assert rounds.prefix_hit_rate > 0


LONG_NEW = 24  # tokens of the long-context parity: the text prompt and these span many windows


def _long_prompts(family):
    """The test prompts and a text prompt of many windows: a long context for the sliding pool."""
    rendered = family.tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join(tiny_gemma4.PROMPTS * 2)}], tokenize=False, add_generation_prompt=True
    )
    return [*tiny_gemma4.prompts(family), family.processor(rendered, None, add_special_tokens=False)]


@pytest.fixture(scope="module")
def long_expected(folder):
    family = load(folder, device="cpu")
    reference = parity.reference_model(folder)
    runs = [parity.reference_greedy(reference, p, family.runner.arch, LONG_NEW) for p in _long_prompts(family)]
    return [[t for t in tokens if t not in family.eos_token_ids] for tokens, _ in runs]


SLIDING_PAGES = 48  # of 4 tokens: fewer than the long prompt's context needs (pages must be reused)


def _sliding_run(family, pipelined, **kw):
    config = EngineConfig(
        pipelined=pipelined, page_size=4, num_pages=256, max_model_len=256, prefill_chunk=8,
        sliding_pages=SLIDING_PAGES, eos_token_ids=family.eos_token_ids, **kw,
    )
    return parity.engine_rounds(family.runner, family.tokenizer, _long_prompts(family), config, LONG_NEW)


@pytest.mark.parametrize("pipelined", [True, False])
def test_sliding_layers_keep_only_their_window(pipelined, folder, long_expected):
    """The sliding layers' K/V lives in a pool of 48 pages (engine/sliding.py), fewer than the long
    prompt's context alone: greedy tokens still equal transformers', first run and again (the image
    cache; prefix hits need the window's pages still cached, which this small a pool evicts: the
    test above reads them), and every page is back at idle."""
    family = load(folder, device="cpu")
    prompts = _long_prompts(family)
    assert pages_needed(len(prompts[-1].token_ids) + LONG_NEW, 4) > SLIDING_PAGES
    rounds = _sliding_run(family, pipelined)
    assert rounds.first == long_expected
    assert rounds.again == long_expected
    assert rounds.free_pages == 256  # and the sliding pool's (parity.engine_rounds checks it)
    kv = family.runner.kv
    assert kv.sliding == frozenset({0, 2}) and kv.window == tiny_gemma4.WINDOW
    assert kv.k[0].shape[0] == (SLIDING_PAGES + 1) * 4 and kv.k[1].shape[0] == (256 + 1) * 4  # memory: the window's


def test_releasing_a_sliding_page_early_breaks_parity(folder, long_expected, monkeypatch):
    """The test above can fail: a pool that lets go of a page one page inside the window moves tokens."""
    family = load(folder, device="cpu")
    early = lambda self, position: max(0, position - self.window + 1 + self.page_size) // self.page_size  # noqa: E731
    monkeypatch.setattr(SlidingPages, "_first_needed", early)
    assert _sliding_run(family, True).first != long_expected


def test_prompts_are_the_templates(folder):
    """A skill call's prompt ids are transformers' apply_chat_template ids for the same turn."""
    family = load(folder, device="cpu")
    image = tiny_gemma4.pictures()[1]
    task = family.query("what is it?")
    ours, _ = family.encode(task, [image], None)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}]}]
    theirs = family.processor.hf_processor.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert ours.token_ids == list(theirs["input_ids"][0])
    assert ours.prefill.num_image_tokens > 0


def test_detect_and_point_answer_normalized_json(folder):
    with foveal.load(folder, device="cpu", max_batch_size=4, max_model_len=512) as model:
        image = tiny_gemma4.pictures()[0]
        boxes = model.detect(image, "red circle", settings={"max_objects": 2})["objects"]
        points = model.point(image, "red circle", settings={"max_objects": 2})["points"]
    for box in boxes:
        assert 0 <= box["x_min"] <= box["x_max"] <= 1 and 0 <= box["y_min"] <= box["y_max"] <= 1
    for point in points:
        assert 0 <= point["x"] <= 1 and 0 <= point["y"] <= 1


def _copy(folder, tmp_path):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    return out


def _edit_config(out, edit):
    data = json.loads((out / "config.json").read_text())
    edit(data)
    (out / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("vision_config"), "no vision_config"),
        (lambda c: c.update(image_token_id=None), "no image_token_id"),
        (lambda c: c["text_config"].update(use_bidirectional_attention="vision"), "use_bidirectional_attention"),
    ],
)
def test_unsupported_configs_are_refused(folder, tmp_path, edit, message):
    out = _copy(folder, tmp_path)
    _edit_config(out, edit)
    with pytest.raises(ModelLoadError, match=message):
        load(out, device="cpu")


def test_a_folder_without_its_image_processor_is_refused(folder, tmp_path):
    out = _copy(folder, tmp_path)
    (out / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no image processor settings \(preprocessor_config.json, or processor_config.json"):
        load(out, device="cpu")


def test_a_folder_missing_a_tensor_is_refused_naming_it(folder, tmp_path):
    out = _copy(folder, tmp_path)
    weights = safetensors.torch.load_file(out / "model.safetensors")
    name = next(k for k in weights if "embed_tokens_per_layer" in k)
    del weights[name]
    safetensors.torch.save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="embed_tokens_per_layer"):
        load(out, device="cpu")


def test_bf16_weights_load_upcast_or_kept(folder, tmp_path):
    out = _copy(folder, tmp_path)
    weights = safetensors.torch.load_file(out / "model.safetensors")
    safetensors.torch.save_file(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    assert load(out, device="cpu").runner.dtype == torch.float32  # CPU default: upcast
    assert load(out, device="cpu", dtype="bfloat16").runner.dtype == torch.bfloat16
