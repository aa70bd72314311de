"""Moondream through the public API on the reference fixture: foveal.load(fixture), then caption, query
(with and without an image), detect and point return the recorded answers, pipelined and blocking, alone
and sharing the batch with other requests."""

from __future__ import annotations

import threading

import pytest

import foveal
from foveal import calls
from foveal.families.moondream.family import parse_regions

IMAGES = ("gradient_300x200", "multicrop_900x500", "small_64x64")
QUESTION = "tok1012 tok318 tok428 tok30"
OBJECT = "tok1011 tok77"


@pytest.fixture(scope="module", params=[True, False], ids=["pipelined", "blocking"])
def model(request, md_dir):
    with foveal.load(md_dir, pipelined=request.param) as model:
        yield model


def expected(model, md_dir, figures, name):
    fig = figures["images"][name]
    decode = model.family.tokenizer.decode
    return {
        "caption": decode(fig["caption_normal"]["greedy_ids"], skip_special_tokens=True),
        "answer": decode(fig["query"]["greedy_ids"], skip_special_tokens=True),
        "objects": [{k: min(1.0, max(0.0, v)) for k, v in box.items()} for box in fig["detect"]["result"]],
        "points": fig["point"]["result"],
    }


def unscored(items):
    """The items without their "score" (the reference has none), after checking each has one in [0, 1]."""
    assert all(0.0 <= item["score"] <= 1.0 for item in items), items
    return [{k: v for k, v in item.items() if k != "score"} for item in items]


def answers(model, image):
    return {
        "caption": model.caption(image, length="normal", settings={"max_tokens": 12})["caption"],
        "answer": model.query(image, QUESTION, settings={"max_tokens": 12})["answer"],
        "objects": unscored(model.detect(image, OBJECT, settings={"max_objects": 3})["objects"]),
        "points": unscored(model.point(image, OBJECT, settings={"max_objects": 3})["points"]),
    }


@pytest.mark.parametrize("name", IMAGES)
def test_recorded_answers(model, md_dir, md_figures, name):
    image = md_dir / md_figures["images"][name]["image"]["file"]
    assert answers(model, image) == expected(model, md_dir, md_figures, name)


def test_raw_boxes_are_the_reference_floats(model, md_dir, md_figures):
    """Unclipped, the detect answer is the reference's boxes exactly (bins / 1024 +- float32 sizes)."""
    for name in IMAGES:
        image = md_dir / md_figures["images"][name]["image"]["file"]
        job = model._prepare(calls.detect(model.family, image, OBJECT, {"max_objects": 3}))
        text = model.engine.submit(job.request).result().text
        assert (
            parse_regions(text, with_size=True, clip=False) == md_figures["images"][name]["detect"]["result"]
        )


def test_sharing_the_batch(model, md_dir, md_figures):
    """All images' calls at once, plus a text-only query: each returns what it returns alone."""
    results: dict = {}

    def run(name):
        results[name] = answers(model, md_dir / md_figures["images"][name]["image"]["file"])

    def text_only():
        results["text"] = model.query(
            None,
            " ".join(f"tok{i}" for i in md_figures["text_only"]["question_ids"]),
            settings={"max_tokens": 12},
        )["answer"]

    threads = [threading.Thread(target=run, args=(name,)) for name in IMAGES] + [
        threading.Thread(target=text_only)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in IMAGES:
        assert results[name] == expected(model, md_dir, md_figures, name)
    ids = md_figures["text_only"]["greedy_ids"]
    assert results["text"] == model.family.tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_and_image_reuse(model, md_dir, md_figures):
    name = "multicrop_900x500"
    image = model.encode_image(md_dir / md_figures["images"][name]["image"]["file"])
    model.caption(image, settings={"max_tokens": 2})
    runner = model.family.runner
    encoded, cached = runner.images_encoded, model.engine.stats()["cached_prompt_tokens"]
    chunks = list(model.query(image, QUESTION, stream=True, settings={"max_tokens": 12})["answer"])
    assert "".join(chunks) == expected(model, md_dir, md_figures, name)["answer"]
    assert (
        unscored(model.detect(image, OBJECT, settings={"max_objects": 3})["objects"])
        == expected(model, md_dir, md_figures, name)["objects"]
    )
    assert runner.images_encoded == encoded  # the vision encoder did not run again for this image
    assert model.engine.stats()["cached_prompt_tokens"] >= cached + 2 * 720  # nor the image prefix's K/V


def test_region_steps_record_the_heads_distributions(model, md_dir, md_figures):
    """Each value of a detect answer carries its head's logprob and alternatives (regions.RegionLogprobs):
    the sampled value among them at its own logprob, best first, a distribution's worth of mass at most;
    the answer is the one recorded without logprobs."""
    from foveal.engine.request import SamplingParams

    name = "multicrop_900x500"
    image = md_dir / md_figures["images"][name]["image"]["file"]
    job = model._prepare(calls.detect(model.family, image, OBJECT, {"max_objects": 3}))
    assert job.request.sampling.logprobs == 20
    out = model.engine.submit(job.request).result()
    plain = model.engine.submit(
        type(job.request)(job.request.prompt_ids, SamplingParams(max_tokens=job.request.sampling.max_tokens),
                          job.task.rules() if job.task.rules else model.family.compile(job.task.spec).matcher(),
                          job.request.prefill)
    ).result()
    assert out.token_ids == plain.token_ids and len(out.logprobs) == len(out.token_ids)
    for entry in out.logprobs:
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True) and 19 <= len(values) <= 20  # a gate: eos may be -inf
        assert sum(__import__("math").exp(v) for v in values) <= 1 + 1e-5
        assert dict(entry.top).get(entry.token_id, entry.logprob) == pytest.approx(entry.logprob, abs=1e-5)
