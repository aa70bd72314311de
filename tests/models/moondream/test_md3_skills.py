"""Moondream 3 through the public API on the moondream3-tiny fixture: `foveal.load(fixture)`, then every
recorded result (caption short / normal, query, reasoning with its answer, spatial references, detect,
point, detect_gaze, text-only query and reasoning) for the base weights (exact tau GELU), the tanh-GELU
variant (`config.text.tau_gelu = "tanh"`) and the skills weights (grounding chunks, the answer-token stop,
several objects, max_objects, both gaze outcomes); pipelined and blocking; every image's calls at once.
"""

from __future__ import annotations

import threading

import pytest

import foveal
from foveal.engine.models.arch import ModelLoadError
from foveal.families.base import UnsupportedSkill
from foveal.families.moondream.family3 import Moondream3Family

from .md3 import IMAGES, figures, skills_folder, tanh_folder

QUESTION = "tok1012 tok318 tok428 tok30"
REASONING_QUESTION = "tok588 tok900 tok469 tok382"
OBJECT = "tok1011 tok77"
TEXT = {"max_tokens": 12}
REGIONS = {"max_objects": 3}
EYES = ((0.3, 0.4), (0.7, 0.6))
REFS = {"point": [[0.25, 0.75]], "box": [[0.1, 0.2, 0.6, 0.7]], "point_and_box": [[0.8, 0.3], [0.15, 0.35, 0.45, 0.9]]}


@pytest.fixture(scope="module")
def folders(md3_dir, tmp_path_factory):
    return {
        "base": (md3_dir, "figures"),
        "tanh": (tanh_folder(md3_dir, tmp_path_factory), "figures_tau_tanh"),
        "skills": (skills_folder(md3_dir, tmp_path_factory), "figures_skills"),
    }


@pytest.fixture(scope="module", params=[True, False], ids=["pipelined", "blocking"])
def models(request, folders):
    loaded = {name: foveal.load(folder, pipelined=request.param) for name, (folder, _) in folders.items()}
    yield loaded
    for model in loaded.values():
        model.close()


def image_of(md3_dir, name):
    return md3_dir / "images" / f"{name}.png"


def text(model, ids):
    return model.family.tokenizer.decode(ids, skip_special_tokens=True)


def unscored(items):
    assert all(0.0 <= item["score"] <= 1.0 for item in items), items
    return [{k: v for k, v in item.items() if k != "score"} for item in items]


def clipped(items):
    return [{k: min(1.0, max(0.0, v)) for k, v in item.items()} for item in items]


def reasoned(model, fig):
    chunks = "".join(text(model, chunk) for chunk in fig["chunks"])
    return {"reasoning": {"text": chunks, "grounding": fig["reasoning"]["grounding"]},
            "answer": text(model, fig["answer"]["greedy_ids"])}


# ---- what each weight set records, and what the model answers ------------------------------------------------


def expected(model, fig, weights):
    out = {}
    for task in ("caption_short", "caption_normal", "query"):
        if task in fig and weights != "skills":
            out[task] = text(model, fig[task]["greedy_ids"])
    out["reasoning"] = reasoned(model, fig["reasoning"])
    out["detect"] = clipped(fig["detect"]["result"])
    out["point"] = fig["point"]["result"]
    for k in range(2):
        if f"detect_gaze_{k}" in fig:
            out[f"gaze_{k}"] = fig[f"detect_gaze_{k}"]["gaze"]
    for case in REFS:
        if f"spatial_refs_{case}" in fig:
            out[f"refs_{case}"] = text(model, fig[f"spatial_refs_{case}"]["greedy_ids"])
    return out


def answered(model, image, want):
    calls = {
        "caption_short": lambda: model.caption(image, length="short", settings=TEXT)["caption"],
        "caption_normal": lambda: model.caption(image, length="normal", settings=TEXT)["caption"],
        "query": lambda: model.query(image, QUESTION, settings=TEXT)["answer"],
        "reasoning": lambda: model.query(image, REASONING_QUESTION, reasoning=True, settings=TEXT),
        "detect": lambda: unscored(model.detect(image, OBJECT, settings=REGIONS)["objects"]),
        "point": lambda: unscored(model.point(image, OBJECT, settings=REGIONS)["points"]),
        **{f"gaze_{k}": (lambda eye=eye: model.detect_gaze(image, eye=eye)["gaze"]) for k, eye in enumerate(EYES)},
        **{f"refs_{case}": (lambda refs=refs: model.query(image, REASONING_QUESTION, spatial_refs=refs,
                                                          settings=TEXT)["answer"]) for case, refs in REFS.items()},
    }
    return {task: calls[task]() for task in want}


@pytest.mark.parametrize("weights", ["base", "tanh", "skills"])
@pytest.mark.parametrize("name", IMAGES)
def test_recorded_results(models, folders, md3_dir, weights, name):
    model = models[weights]
    fig = figures(md3_dir, folders[weights][1])["images"][name]
    want = expected(model, fig, weights)
    assert answered(model, image_of(md3_dir, name), want) == want


@pytest.mark.parametrize("weights", ["base", "tanh"])
def test_text_only(models, folders, md3_dir, weights):
    model = models[weights]
    fig = figures(md3_dir, folders[weights][1])["text_only"]
    question = " ".join(f"tok{i}" for i in figures(md3_dir)["text_only"]["question_ids"])
    assert model.query(None, question, settings=TEXT)["answer"] == text(model, fig["query"]["greedy_ids"])
    if "reasoning" in fig:
        assert model.query(None, question, reasoning=True, settings=TEXT) == reasoned(model, fig["reasoning"])


def test_every_image_at_once(models, md3_dir):
    """All images' calls on both weight sets in threads, sharing the engine's batches: each as alone."""
    results: dict = {}
    wanted = {(w, n): expected(models[w], figures(md3_dir, f)["images"][n], w)
              for w, f in (("base", "figures"), ("skills", "figures_skills")) for n in IMAGES}

    def run(key):
        results[key] = answered(models[key[0]], image_of(md3_dir, key[1]), wanted[key])

    threads = [threading.Thread(target=run, args=(key,)) for key in wanted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == wanted


def test_the_skills_weights_reach_both_stops_and_several_objects(md3_dir):
    """The recordings exercise what the base weights miss: the answer-token stop, several objects, gaze None."""
    fig = figures(md3_dir, "figures_skills")["images"]
    assert {fig[n]["reasoning"]["reasoning_stop"] for n in IMAGES} == {"answer_id"}
    assert max(len(fig[n]["detect"]["result"]) for n in IMAGES) >= 2
    assert fig["tall_90x160"]["point"]["stop"] == "max_objects"
    gazes = [fig[n][f"detect_gaze_{k}"]["gaze"] for n in IMAGES for k in range(2)]
    assert None in gazes and any(g is not None for g in gazes)


def test_loaded_as_moondream_3(models):
    family = models["base"].family
    assert isinstance(family, Moondream3Family)
    assert family.config.generation == 3 and family.config.text.tau_gelu == "exact"
    assert models["tanh"].family.config.text.tau_gelu == "tanh"


def test_variants_and_reasoning_with_refs_are_refused(models, md3_dir):
    model = models["base"]
    image = image_of(md3_dir, IMAGES[0])
    with pytest.raises(UnsupportedSkill, match="variant"):
        model.caption(image, settings={"variant": "x"})
    with pytest.raises(UnsupportedSkill, match="spatial_refs together with reasoning"):
        model.query(image, QUESTION, reasoning=True, spatial_refs=[[0.5, 0.5]])


def test_a_checkpoint_of_no_known_revision_is_refused(md3_dir, tmp_path):
    """A Moondream 3 file without its expert stacks is refused naming what it lacks."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((md3_dir / name).read_bytes())
    state = load_file(md3_dir / "model.safetensors")
    del state["model.text.blocks.3.mlp.fc1.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor\(s\) of the Moondream 3 layout.*blocks\.3\.mlp\.fc1"):
        foveal.load(folder)
    state = load_file(md3_dir / "model.safetensors")
    state["model.text.blocks.2.mlp.router.weight"] = state["model.text.blocks.2.mlp.router.weight"][:4]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"blocks\.2\.mlp\.router\.weight has shape \[4, 128\]"):
        foveal.load(folder)
