"""Moondream's remaining skills against the fixture's `figures_skills.*`, through the public API:
grounded reasoning, spatial references on query, detect_gaze and a LoRA variant, pipelined and
blocking, alone and sharing the batch, on the `base` weights and the `skills` weights (the fixture's
lm_head replacement, written into a model folder here)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from safetensors.torch import load_file, save_file

import foveal
from foveal import calls
from foveal.families.moondream.family import parse_reasoning
from foveal.families.moondream.region import coord_id

IMAGES = ("gradient_300x200", "multicrop_900x500", "small_64x64")
QUESTION = "tok588 tok900 tok469 tok382"
BASE_QUESTION = "tok1012 tok318 tok428 tok30"
OBJECT = "tok1011 tok77"
VARIANT = "tiny-lora-a"
GREEDY = {"max_tokens": 12}


@pytest.fixture(scope="session")
def skills_figures(md_dir):
    return json.loads((md_dir / "figures_skills.json").read_text())


@pytest.fixture(scope="session")
def skills_dir(md_dir, tmp_path_factory):
    """The fixture's folder with the `skills` weights: lm_head replaced by skills_lm_head.safetensors."""
    folder = tmp_path_factory.mktemp("moondream-skills")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(md_dir / name, folder / name)
    shutil.copytree(md_dir / "variants", folder / "variants")
    state = load_file(md_dir / "model.safetensors")
    state.update(load_file(md_dir / "skills_lm_head.safetensors"))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["pipelined", "blocking"])
def models(request, md_dir, skills_dir):
    base = foveal.load(md_dir, pipelined=request.param)
    skills = foveal.load(skills_dir, pipelined=request.param)
    yield {"base": base, "skills": skills}
    base.close()
    skills.close()


def image_of(md_dir, name):
    return md_dir / "images" / f"{name}.png"


def decode(model, ids):
    return model.family.tokenizer.decode(ids, skip_special_tokens=True)


# ---- expected values from the recordings ------------------------------------------------------------------


def reasoned(figures, name, weights):
    recorded = figures["images"][name]["reasoning"][weights]["with_standin_tokenizer"]
    return {"reasoning": recorded["reasoning"], "answer": recorded["answer"]}


def spatial_answer(model, figures, name, case):
    return decode(model, figures["images"][name]["spatial_refs"][case]["greedy_ids"])


def lora_answers(model, figures, name, mode):
    fig = figures["images"][name]["lora"][mode]
    return {
        "caption": decode(model, fig["caption_normal"]["greedy_ids"]),
        "answer": decode(model, fig["query"]["greedy_ids"]),
        "objects": [{k: min(1.0, max(0.0, v)) for k, v in box.items()} for box in fig["detect"]["result"]],
        "points": fig["point"]["result"],
    }


def lora_calls(model, image, variant):
    settings = {"variant": variant} if variant else {}
    points = model.point(image, OBJECT, settings={**settings, "max_objects": 3})["points"]
    return {
        "caption": model.caption(image, settings={**settings, **GREEDY})["caption"],
        "answer": model.query(image, BASE_QUESTION, settings={**settings, **GREEDY})["answer"],
        "objects": [_box(b) for b in model.detect(image, OBJECT, settings={**settings, "max_objects": 3})["objects"]],
        "points": [{"x": p["x"], "y": p["y"]} for p in points],
    }


def _box(box):
    return {k: box[k] for k in ("x_min", "y_min", "x_max", "y_max")}


# ---- the skills, one by one ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("weights", ["base", "skills"])
def test_reasoning(models, md_dir, skills_figures, name, weights):
    """query(reasoning=True): the reasoning's text and groundings (coordinates decoded by the region
    heads inside the pipeline) and the answer after it, as the reference returned them."""
    model = models[weights]
    result = model.query(image_of(md_dir, name), QUESTION, reasoning=True, settings=GREEDY)
    assert result == reasoned(skills_figures, name, weights)
    assert list(result) == ["reasoning", "answer"]


def test_reasoning_groundings_are_recorded(skills_figures):
    """The fixture's skills weights do ground (so the test above sees groundings, one and several points)."""
    counts = [len(skills_figures["images"][n]["reasoning"]["skills"]["reasoning"]["grounding"]) for n in IMAGES]
    assert sum(counts) >= 2


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("weights", ["base", "skills"])
def test_reasoning_offsets_with_the_stub_tokenizer(skills_figures, name, weights):
    """start_idx / end_idx as the reference computes them with its stub tokenizer (every id '<id>'):
    chunks opened at start-ground / end-ground, each chunk decoded on its own."""
    fig = skills_figures["images"][name]["reasoning"][weights]
    coords = iter(step["argmax"] for step in fig["coord_steps"])
    ids = [coord_id(1024, next(coords)) if i == 5 else i for i in fig["reasoning_ids"]]
    if fig["reasoning_stop"] == "answer_id":
        ids.append(3)  # the id that ended it: not part of the reasoning

    def stub(chunk, skip_special_tokens):
        return "".join(f"<{i}>" for i in chunk)

    tokens = type("Ids", (), {"coord_id": 5, "start_ground_points_id": 7, "end_ground_id": 9})
    thought, fed = parse_reasoning(ids[:-1] if ids[-1] == 3 else ids, stub, tokens, 1024)
    assert thought.as_dict() == fig["reasoning"]
    assert len(fed) == len(fig["reasoning_ids"])


def test_reasoning_streams_the_answer(models, md_dir, skills_figures):
    name = "multicrop_900x500"
    model = models["skills"]
    result = model.query(image_of(md_dir, name), QUESTION, reasoning=True, stream=True, settings=GREEDY)
    expected = reasoned(skills_figures, name, "skills")
    assert result["reasoning"] == expected["reasoning"]
    assert "".join(result["answer"]) == expected["answer"]


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("case", ["none", "point", "box", "point_and_box"])
def test_spatial_refs(models, md_dir, skills_figures, name, case):
    """Points and boxes encoded into the query's prompt at the reference's coord / size positions."""
    model = models["base"]
    refs = skills_figures["settings"]["spatial_refs"][case]
    answer = model.query(image_of(md_dir, name), QUESTION, spatial_refs=refs, settings=GREEDY)["answer"]
    assert answer == spatial_answer(model, skills_figures, name, case)


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("weights", ["base", "skills"])
def test_detect_gaze(models, md_dir, skills_figures, name, weights):
    """A gaze point where the reference found one, None where its first decision was eos."""
    for recorded in skills_figures["images"][name]["detect_gaze"][weights]:
        got = models[weights].detect_gaze(image_of(md_dir, name), eye=tuple(recorded["eye"]))
        assert got == {"gaze": recorded["gaze"]}


@pytest.mark.parametrize("name", IMAGES)
def test_variant_and_base_on_one_image(models, md_dir, skills_figures, name):
    """settings['variant'] applies the LoRA to the whole call (image prefix included), as the reference's
    `variant` mode; calls without it on the same image, before and after, stay the base recordings
    (the prefix cache never hands a variant's pages to a base call, nor the reverse)."""
    model = models["base"]
    image = image_of(md_dir, name)
    base = lora_answers(model, skills_figures, name, "no_variant")
    assert lora_calls(model, image, None) == base
    assert lora_calls(model, image, VARIANT) == lora_answers(model, skills_figures, name, "variant")
    assert lora_calls(model, image, None) == base


def test_text_only_variant_and_refs_keep_their_own_pages(models, md_dir):
    """Without an image, a variant or spatial refs salt the prompt's cache key (PrefillInputs.cache_salt):
    a base call after a variant call of the same text still answers as before, and the variant (refs)
    answer is the one a fresh model gives, so no page crossed between them."""
    model = models["base"]
    ask = {"max_tokens": 12, **GREEDY}
    base = model.query(None, QUESTION, settings=ask)["answer"]
    variant = model.query(None, QUESTION, settings={**ask, "variant": VARIANT})["answer"]
    refs = model.query(None, QUESTION, spatial_refs=[[0.25, 0.5]], settings=ask)["answer"]
    assert model.query(None, QUESTION, settings=ask)["answer"] == base
    assert variant != base and refs != base  # the adapter and the refs do reach the text-only prompt
    fresh = foveal.load(md_dir, pipelined=model.config.pipelined)
    try:
        assert fresh.query(None, QUESTION, settings={**ask, "variant": VARIANT})["answer"] == variant
        assert fresh.query(None, QUESTION, spatial_refs=[[0.25, 0.5]], settings=ask)["answer"] == refs
    finally:
        fresh.close()


def test_variant_by_path(models, md_dir, skills_figures):
    name = "small_64x64"
    path = str(md_dir / "variants" / f"{VARIANT}.safetensors")
    got = models["base"].caption(image_of(md_dir, name), settings={"variant": path, **GREEDY})["caption"]
    assert got == lora_answers(models["base"], skills_figures, name, "variant")["caption"]


def test_sharing_the_batch(models, md_dir, skills_figures):
    """Reasoning, spatial references, gaze, variant and base calls at once return what they return alone."""
    base, skills = models["base"], models["skills"]
    calls = {}
    for name in IMAGES:
        image = image_of(md_dir, name)
        calls[(name, "reason")] = (
            lambda image=image: skills.query(image, QUESTION, reasoning=True, settings=GREEDY),
            reasoned(skills_figures, name, "skills"),
        )
        refs = skills_figures["settings"]["spatial_refs"]["point_and_box"]
        calls[(name, "refs")] = (
            lambda image=image, refs=refs: base.query(image, QUESTION, spatial_refs=refs, settings=GREEDY)["answer"],
            spatial_answer(base, skills_figures, name, "point_and_box"),
        )
        eye = skills_figures["images"][name]["detect_gaze"]["skills"][0]
        calls[(name, "gaze")] = (
            lambda image=image, eye=eye: skills.detect_gaze(image, eye=tuple(eye["eye"])),
            {"gaze": eye["gaze"]},
        )
        calls[(name, "variant")] = (
            lambda image=image: lora_calls(base, image, VARIANT),
            lora_answers(base, skills_figures, name, "variant"),
        )
        calls[(name, "base")] = (
            lambda image=image: lora_calls(base, image, None),
            lora_answers(base, skills_figures, name, "no_variant"),
        )
    got: dict = {}
    threads = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f())) for k, (f, _) in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {k: got.get(k) for k in calls} == {k: want for k, (_, want) in calls.items()}


# ---- refusals -------------------------------------------------------------------------------------------------


def test_refusals(models, md_dir):
    model = models["base"]
    image = image_of(md_dir, "small_64x64")
    with pytest.raises(ValueError, match="spatial_refs together with reasoning"):
        model.query(image, QUESTION, reasoning=True, spatial_refs=[[0.5, 0.5]])
    with pytest.raises(ValueError, match=r"neither a point"):
        model.query(image, QUESTION, spatial_refs=[[0.5, 0.5, 0.7]])
    with pytest.raises(ValueError, match=r"x1 > x2"):
        model.query(image, QUESTION, spatial_refs=[[0.6, 0.5, 0.4, 0.7]])
    with pytest.raises(ValueError, match=r"variant 'no-such' was not found.*variants/no-such.safetensors"):
        model.caption(image, settings={"variant": "no-such"})
    with pytest.raises(ValueError, match="face= and unstable_settings"):
        model.detect_gaze(image, eye=(0.5, 0.5), unstable_settings={"prioritize_accuracy": True})
    with pytest.raises(ValueError, match=r"eye\[0\]"):
        model.detect_gaze(image, eye=(1.5, 0.5))


def test_reference_defaults(models):
    """Captions and answers default to the reference's 768 tokens; an explicit max_tokens is kept."""
    model = models["base"]
    assert calls.caption(model.family, None, "normal").settings.max_tokens == 768
    assert calls.query(model.family, None, QUESTION).settings.max_tokens == 768
    assert calls.query(model.family, None, QUESTION, settings={"max_tokens": 5}).settings.max_tokens == 5
