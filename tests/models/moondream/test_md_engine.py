"""Moondream through foveal.load on a tiny random checkpoint (built here; no ../shared): region steps in the
two-slot pipeline, pipelined == blocking, batching, max_objects, eos, image reuse, streaming, text-only."""

from __future__ import annotations

import threading
import typing

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import foveal
from foveal import calls as skill_calls
from foveal.engine.models import ModelLoadError
from foveal.errors import IncompleteOutputError
from foveal.testing import moondream

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return moondream.build(tmp_path_factory.mktemp("md") / "tiny")


@pytest.fixture(scope="module")
def models(folder):
    pipelined, blocking = foveal.load(folder), foveal.load(folder, pipelined=False)
    yield pipelined, blocking
    pipelined.close()
    blocking.close()


def images():
    rng = np.random.default_rng(0)
    return [(rng.random(shape) * 255).astype(np.uint8) for shape in ((200, 300, 3), (500, 900, 3))]


def calls(model, image):
    return [
        model.detect(image, "red car", settings={**GREEDY, "max_objects": 4}),
        model.point(image, "blue dot", settings={**GREEDY, "max_objects": 3}),
        model.caption(image, settings={**GREEDY, "max_tokens": 8}),
        model.query(image, "what is this?", settings={**GREEDY, "max_tokens": 6}),
    ]


def test_pipelined_equals_blocking(models):
    pipelined, blocking = models
    for image in images():
        assert calls(pipelined, image) == calls(blocking, image)


def test_batched_equals_alone(models):
    """Detect / point / caption requests sharing steps give what each gives alone."""
    model = models[0]
    alone = [calls(model, image) for image in images()]
    together: dict[int, list] = {}

    def run(i, image):
        together[i] = calls(model, image)

    threads = [threading.Thread(target=run, args=(i, im)) for i, im in enumerate(images())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[0], together[1]] == alone


def test_max_objects_is_enforced(models):
    model = models[0]
    image = images()[0]
    # this random model never answers eos, so every answer runs to max_objects
    for n in (1, 2, 5):
        assert len(model.detect(image, "car", settings={"max_objects": n})["objects"]) == n
        assert len(model.point(image, "car", settings={"max_objects": n})["points"]) == n
    result = model.detect(image, "car", settings={"max_objects": 2})
    assert result.usage.completion_tokens == 6  # x, y, size per object; no step after the last one
    assert result.usage.finish_reason == "stop"


def test_a_cut_region_answer_is_incomplete(models):
    with pytest.raises(IncompleteOutputError):
        models[0].detect(images()[0], "car", settings={"max_objects": 3, "max_tokens": 4})


def test_image_encoded_once_across_calls(models):
    model = models[0]
    runner = model.family.runner
    image = (np.random.default_rng(7).random((64, 64, 3)) * 255).astype(np.uint8)
    first = model.query(image, "how many?", settings={"max_tokens": 4})
    encoded = runner.images_encoded
    second = model.query(image, "how many?", settings={"max_tokens": 4})
    model.detect(image, "car", settings={"max_objects": 1})
    assert runner.images_encoded == encoded  # the vision encoder did not run again
    assert second == first


def test_streaming_caption_and_text_only_query(models):
    model = models[0]
    image = images()[0]
    whole = model.caption(image, settings={"max_tokens": 8})["caption"]
    chunks = list(model.caption(image, stream=True, settings={"max_tokens": 8})["caption"])
    assert len(chunks) > 1 and "".join(chunks) == whole
    answer = model.query(None, "hello there", settings={"max_tokens": 5})["answer"]
    assert answer == "".join(
        model.query(None, "hello there", stream=True, settings={"max_tokens": 5})["answer"]
    )
    with pytest.raises(ValueError, match="needs an image"):
        model.detect(None, "car")


def test_generate_with_a_grammar(models):
    out = models[0].generate(images()[0], "pick one", output_type=typing.Literal["yes", "no"])
    assert out["output"] in ("yes", "no")


def test_pools_full_at_idle(models):
    for model in models:
        model.engine.wait_idle(10)
        assert model.engine.free_pages() == model.engine.config.num_pages
        assert model.engine.lanes.num_free == model.engine.lanes.count


def test_eos_ends_region_answers(tmp_path):
    folder = moondream.build(tmp_path / "eos")
    state = load_file(folder / "model.safetensors")
    state["model.text.lm_head.bias"][0] = 100.0  # eos always wins the stop-or-continue step
    save_file(state, folder / "model.safetensors")
    with foveal.load(folder) as model:
        image = images()[0]
        detected = model.detect(image, "car")
        assert detected == {"objects": []} and detected.usage.finish_reason == "stop"
        assert model.point(image, "car") == {"points": []}


def test_older_layout_refused_at_load(tmp_path):
    folder = moondream.build(tmp_path / "old")
    save_file(
        {"vision_encoder.encoder.model.visual.pos_embed": torch.zeros(1, 2)}, folder / "model.safetensors"
    )
    with pytest.raises(
        ModelLoadError, match=r"older vision_encoder.*foveal supports model\.\{vision,text,region\}"
    ):
        foveal.load(folder)


def test_cancel_mid_answer_frees_everything(models):
    """A detect answer cancelled while its region steps are in flight ends CANCELLED; pages and lanes come back."""
    for model in models:
        call = skill_calls.detect(model.family, images()[0], "car", {"max_objects": 300})
        handle = model.engine.submit(model._prepare(call).request)
        first = next(iter(handle))  # a region value has been committed and spelled
        assert first.startswith("<coord ")
        handle.cancel()
        assert handle.result(10).finish_reason == "cancelled"
        assert model.engine.wait_idle(10)
        assert model.engine.free_pages() == model.engine.config.num_pages
        assert model.engine.lanes.num_free == model.engine.lanes.count


def test_bfloat16_on_cpu(folder):
    """Stored bf16 weights used as bf16: answers are well formed (bf16 is not compared with fp32)."""
    with foveal.load(folder, dtype="bfloat16") as model:
        assert model.family.runner.dtype == torch.bfloat16
        result = model.detect(images()[0], "car", settings={"max_objects": 2})
        assert len(result["objects"]) == 2
        assert model.caption(images()[0], settings={"max_tokens": 4})["caption"]


def test_image_prefix_pages_shared_across_calls(folder, models):
    """A second call on one image takes BOS + image pages from the prefix cache (keyed by the image: kv_cache.prefix_seed),
    and answers exactly as without the cache."""
    image = (np.random.default_rng(11).random((300, 300, 3)) * 255).astype(np.uint8)
    model = models[0]
    model.query(image, "what is this?", settings={"max_tokens": 4})
    before = model.engine.stats()["cached_prompt_tokens"]
    cached = [model.query(image, "how many?", settings={"max_tokens": 6}), model.detect(image, "car")]
    assert model.engine.stats()["cached_prompt_tokens"] - before >= 2 * 720  # 45 full pages of 16 each time
    with foveal.load(folder, prefix_cache=False) as plain:
        assert [
            plain.query(image, "how many?", settings={"max_tokens": 6}),
            plain.detect(image, "car"),
        ] == cached
        assert plain.engine.stats()["cached_prompt_tokens"] == 0


def test_seeded_sampling_pipelined_equals_blocking(models):
    pipelined, blocking = models
    settings = {"temperature": 1.0, "seed": 3, "max_tokens": 8}
    boxes = {"temperature": 1.0, "seed": 3, "max_objects": 3}
    for image in images():
        assert pipelined.caption(image, settings=settings) == blocking.caption(image, settings=settings)
        assert pipelined.detect(image, "car", settings=boxes) == blocking.detect(image, "car", settings=boxes)
