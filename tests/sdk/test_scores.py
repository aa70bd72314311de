"""Scores of boxes and points (foveal.families.scores): the definition on hand-made distributions, and the
invariants through the public API: every item scored in [0, 1], scores never change a sampled token,
settings["min_score"] drops the items below it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import foveal
from foveal import calls
from foveal.engine.request import TokenLogprob
from foveal.families import scores as scoring
from foveal.families.qwen_vl.grounding import GroundingSpec
from foveal.grammars import spatial
from foveal.vision import scenes


class Vocabulary:
    """A tokenizer handle of named tokens (what scorers read): bytes per id, ids of special tokens."""

    def __init__(self, tokens: list[str], special: set[str]) -> None:
        self.tokens = tokens
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.special = special
        self.eos_token_id = self.ids["<eos>"]

    def token_bytes(self) -> list[bytes]:
        return [b"" if t in self.special else t.encode() for t in self.tokens]

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def step(self, token: str, *alternatives: tuple[str, float], p: float = 1.0) -> tuple[int, TokenLogprob]:
        """A step that sampled `token` with probability p, beside the given (token, probability) alternatives."""
        top = [(self.ids[token], math.log(p))] + [(self.ids[t], math.log(q)) for t, q in alternatives]
        return self.ids[token], TokenLogprob(self.ids[token], math.log(p), tuple(top))

    def forced(self, token: str) -> tuple[int, TokenLogprob]:
        return self.ids[token], TokenLogprob(self.ids[token], 0.0, ())


def decoded(vocab: Vocabulary, steps: list[tuple[int, TokenLogprob]]) -> scoring.Decoded:
    return scoring.Decoded(
        [t for t, _ in steps], [lp for _, lp in steps], vocab, frozenset({vocab.eos_token_id})
    )


LOC = spatial.LocationFormat(32).tokens()


def test_loc_boxes_score_going_on_times_the_coordinates_mass_near_the_chosen_bins():
    vocab = Vocabulary(["<eos>", *LOC, " circle", " ;", " "], {"<eos>", *LOC})
    spec = spatial.boxes("loc", 5, "circle", 32)
    loc = spatial.LocationFormat(32).token
    steps = [
        # ymin bin 3 of a box 8 bins high: tolerance a quarter of that, 2 bins: bins 3 and 4 count, 20 not
        vocab.step(loc(3), (loc(4), 0.2), ("<eos>", 0.2), (loc(20), 0.1), p=0.5),
        vocab.forced(loc(2)),
        vocab.forced(loc(11)),
        vocab.forced(loc(12)),
        vocab.forced(" circle"),
        vocab.step(" ;", ("<eos>", 0.4), p=0.6),  # the answer could have ended here: P(going on) 0.6
        vocab.forced(" "),
        *(vocab.forced(loc(k)) for k in (20, 20, 25, 25)),
        vocab.forced(" circle"),
    ]
    scores = scoring.spatial_scores(spec, decoded(vocab, steps))
    assert scores == pytest.approx([(1 - 0.2) * (0.5 + 0.2), 0.6])


def test_grounding_digits_score_each_token_by_the_number_it_would_have_written():
    text_tokens = ["```json\n[", "\n\t", '{"bbox_2d": [', ", ", '], "label": "car"}', ",\n\t", "\n", "]\n```"]
    vocab = Vocabulary(["<eos>", *text_tokens, *"0123456789", "]"], {"<eos>"})
    spec = GroundingSpec("boxes", max_objects=4, label="car", width=100, height=100)
    steps = [
        vocab.forced("```json\n["),
        vocab.step("\n\t", ("]", 0.25), p=0.75),  # "]" closes an empty answer: P(going on) 0.75
        vocab.forced('{"bbox_2d": ['),
        # x1 = 10 of a box 40 wide (tolerance 10): "2" writes 20 (near), "8" writes 80 (far)
        vocab.step("1", ("2", 0.3), ("8", 0.2), p=0.5),
        vocab.forced("0"),
        vocab.step(", ", ("5", 0.1), p=0.9),  # "5" would have written 105
        vocab.forced("2"),
        vocab.forced("0"),
        vocab.forced(", "),
        vocab.forced("5"),
        vocab.forced("0"),
        vocab.forced(", "),
        vocab.forced("6"),
        vocab.forced("0"),
        vocab.forced('], "label": "car"}'),
        vocab.step(",\n\t", ("\n", 0.5), p=0.5),  # "\n" starts the closing text: P(going on) 0.5
        vocab.forced('{"bbox_2d": ['),
        *(vocab.forced(t) for t in ("7", ", ", "7", ", ", "9", ", ", "9")),
        vocab.forced('], "label": "car"}'),
        vocab.forced("\n"),
    ]
    answer = b"".join(vocab.token_bytes()[t] for t, _ in steps).decode() + "]\n```"
    assert len(spatial.parse(spec, answer)["objects"]) == 2  # the steps spell an answer of the grammar
    scores = scoring.spatial_scores(spec, decoded(vocab, steps))
    assert scores == pytest.approx([0.75 * (0.5 + 0.3) * 0.9, 0.5])


def test_json_decimals_score_the_numbers_each_token_would_have_written():
    pieces = ['{"points": [', '{"x": ', ', "y": ', "}", "]}", ".", *"0123456789"]
    vocab = Vocabulary(["<eos>", *pieces], {"<eos>"})
    steps = [
        vocab.forced('{"points": ['),
        vocab.step('{"x": ', ("]}", 0.2), p=0.8),  # "]}" would have answered no point
        vocab.forced("0"),
        vocab.forced("."),
        vocab.forced("5"),
        vocab.step("2", ("3", 0.3), ("9", 0.1), p=0.6),  # 0.53 is within 0.05 of 0.52, 0.59 is not
        vocab.forced(', "y": '),
        vocab.forced("1"),
        vocab.forced("}"),
        vocab.forced("]}"),
    ]
    scores = scoring.spatial_scores(spatial.points("json", 3), decoded(vocab, steps))
    assert scores == pytest.approx([0.8 * (0.6 + 0.3)])


@pytest.mark.parametrize("seed", range(5))
def test_scores_are_probabilities_whatever_the_distributions(seed):
    rng = np.random.default_rng(seed)
    vocab = Vocabulary(["<eos>", *LOC, " ;", " "], {"<eos>", *LOC})
    spec = spatial.points("loc", 8, "", 32)

    def step(token: str) -> tuple[int, TokenLogprob]:
        others = [t for t in rng.choice(["<eos>", *LOC], 6, replace=False) if t != token]
        p = rng.dirichlet(np.ones(len(others) + 1))
        return vocab.step(token, *zip(others, p[1:], strict=True), p=float(p[0]))

    steps, items = [], int(rng.integers(1, 6))
    for i in range(items):
        steps += [step(" ;"), step(" ")] if i else []
        steps += [step(LOC[int(rng.integers(32))]) for _ in range(2)]
    scores = scoring.spatial_scores(spec, decoded(vocab, steps))
    assert len(scores) == items
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_a_scorer_without_logprobs_says_how_to_get_them():
    vocab = Vocabulary(["<eos>", *LOC], {"<eos>", *LOC})
    steps = [vocab.forced(LOC[1]), vocab.forced(LOC[2])]
    bare = scoring.Decoded([t for t, _ in steps], [], vocab)
    with pytest.raises(ValueError, match="logprobs=20"):
        scoring.spatial_scores(spatial.points("loc", 2, "", 32), bare)


# ---- through the public API, on the embedded model ---------------------------------------------------------


@pytest.fixture(scope="module")
def embedded():
    with foveal.load() as model:
        yield model


@pytest.fixture(scope="module")
def scene_images() -> list:
    return [scenes.render(scenes.generate_scene(seed, 96)) for seed in range(3)]


@pytest.mark.parametrize("skill,key", [("detect", "objects"), ("point", "points")])
def test_every_box_and_point_carries_a_score_in_0_1(embedded, scene_images, skill, key):
    results = [getattr(embedded, skill)(image, "shape") for image in scene_images]
    items = [item for result in results for item in result[key]]
    assert items, "the embedded model answers shapes in its own scenes"
    assert all(isinstance(item["score"], float) and 0.0 <= item["score"] <= 1.0 for item in items)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}])
def test_scores_never_change_the_sampled_tokens(embedded, scene_images, sampling):
    for image in scene_images:
        call = calls.detect(embedded.family, image, "shape", sampling)
        job = embedded._prepare(call)
        assert job.request.sampling.logprobs == scoring.SCORE_ALTERNATIVES
        scored = embedded.engine.submit(job.request).result()
        plain = dataclasses.replace(
            job.request, sampling=dataclasses.replace(job.request.sampling, logprobs=None)
        )
        plain.matcher = embedded._prepare(call).request.matcher  # a fresh automaton state
        unscored = embedded.engine.submit(plain).result()
        assert scored.token_ids == unscored.token_ids and unscored.logprobs is None


def test_min_score_drops_the_items_below_it(embedded, scene_images):
    everything = [embedded.detect(image, "shape") for image in scene_images]
    scores = sorted(o["score"] for r in everything for o in r["objects"])
    threshold = scores[len(scores) // 2]
    for image, whole in zip(scene_images, everything, strict=True):
        kept = embedded.detect(image, "shape", settings={"min_score": threshold})
        assert kept["objects"] == [o for o in whole["objects"] if o["score"] >= threshold]
    assert embedded.detect(scene_images[0], "shape", settings={"min_score": 1.0})["objects"] == [
        o for o in everything[0]["objects"] if o["score"] >= 1.0
    ]


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True, float("nan")])
def test_min_score_out_of_range_is_refused(embedded, scene_images, bad):
    with pytest.raises(ValueError, match="setting .min_score. = .* is not accepted"):
        embedded.detect(scene_images[0], "shape", settings={"min_score": bad})


def test_min_score_belongs_to_detect_and_point(embedded, scene_images):
    with pytest.raises(ValueError, match="'min_score' applies to detect, point"):
        embedded.caption(scene_images[0], settings={"min_score": 0.5})


def test_results_carry_checked_scores_into_their_notebook_view(embedded, scene_images):
    from foveal.results import DetectResult, PointResult

    result = embedded.detect(scene_images[0], "shape")
    assert "&quot;score&quot;" in result._repr_html_()  # the dict's text under the drawn image
    box = {"x_min": 0.1, "y_min": 0.1, "x_max": 0.5, "y_max": 0.5}
    with pytest.raises(ValueError, match=r"objects\[0\]\['score'\] = 1.5"):
        DetectResult([{**box, "score": 1.5}])
    with pytest.raises(ValueError, match=r"points\[0\]\['score'\]"):
        PointResult([{"x": 0.5, "y": 0.5, "score": float("nan")}])


@pytest.fixture(scope="module")
def digit_models(tmp_path_factory):
    """Families that write coordinates in digits: Qwen's grounding JSON (pixels, thousandths)."""
    from foveal.testing import tiny

    root = tmp_path_factory.mktemp("digit_models")
    loaded = {
        f: foveal.load(tiny.build(f, root / f), device="cpu") for f in ("qwen2_5_vl", "qwen3_vl", "idefics3")
    }
    yield loaded
    for model in loaded.values():
        model.close()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_digit_coordinates_are_scored_item_by_item(digit_models, family, skill="detect", key="objects"):
    """(The tiny random models answer points with no item under most seeds: boxes only.)"""
    model, items = digit_models[family], 0
    image = scenes.render(scenes.generate_scene(1, 96))
    for seed in range(40):  # random weights: sampled answers, some with items
        if items >= 2:
            break
        settings = {"max_objects": 3, "temperature": 1.0, "seed": seed}
        found = getattr(model, skill)(image, "red circle", settings=settings)[key]
        assert all(0.0 <= item["score"] <= 1.0 for item in found)
        items += len(found)
    assert items  # the scorer read as many items as the parser
