"""The score evaluation (foveal.training.eval_scores) and the RefCOCO-style entry (eval_refcoco): their
scenes, their metrics on hand-made detections, and a small run of each with the embedded model."""

from __future__ import annotations

import json

import pytest

from foveal.training import eval_refcoco, eval_scores, eval_shapes
from foveal.vision import scenes

SEEDS = range(eval_scores.SEED_BASE, eval_scores.SEED_BASE + 60)


@pytest.mark.parametrize("seed", SEEDS)
def test_hard_scenes_hold_4_to_8_visible_objects_some_small(seed):
    scene = eval_scores.hard_scene(seed)
    assert scene == eval_scores.hard_scene(seed)
    assert eval_scores.MIN_OBJECTS <= len(scene.objects) <= eval_scores.MAX_OBJECTS
    side = min(scene.width, scene.height)
    for i, a in enumerate(scene.objects):
        assert 0 <= a.x0 < a.x1 <= scene.width and 0 <= a.y0 < a.y1 <= scene.height
        assert a.x1 - a.x0 <= eval_scores.MAX_SIZE * side
        for b in scene.objects[i + 1 :]:
            assert eval_scores._visible_beside(a, b)


def test_hard_scenes_are_harder_than_the_training_world():
    hard = [eval_scores.hard_scene(seed) for seed in SEEDS]
    assert max(len(s.objects) for s in hard) > scenes.MAX_OBJECTS
    small = [o for s in hard for o in s.objects if o.x1 - o.x0 < scenes.MIN_SIZE * min(s.width, s.height)]
    assert small
    overlapping = [
        s for s in hard if any(not scenes._apart(a, b) for a in s.objects for b in s.objects if a is not b)
    ]
    assert overlapping


def test_every_scene_asks_a_present_phrase_and_an_absent_one():
    case_list = eval_scores.cases(20)
    assert [c.phrase for c in case_list] == [c.phrase for c in eval_scores.cases(20)]
    present = case_list[0::2]
    absent = case_list[1::2]
    assert all(c.truth for c in present) and all(not c.truth for c in absent)


def test_roc_auc_counts_pairs_ranked_right_and_ties_as_half():
    assert eval_scores.roc_auc([0.9, 0.8], [0.1]) == 1.0
    assert eval_scores.roc_auc([0.1], [0.9, 0.8]) == 0.0
    assert eval_scores.roc_auc([0.5, 0.5], [0.5]) == 0.5
    assert eval_scores.roc_auc([0.9, 0.2], [0.5]) == 0.5
    assert eval_scores.roc_auc([], [0.5]) is None


def _box(o: scenes.SceneObject, scene: scenes.Scene, score: float, shift: float = 0.0) -> dict:
    x0, y0, x1, y1 = o.box(scene.width, scene.height)
    return {"x_min": x0 + shift, "y_min": y0, "x_max": x1 + shift, "y_max": y1, "score": score}


def test_coco_ap_rewards_scores_that_put_true_boxes_first():
    case_list = [c for c in eval_scores.cases(10) if c.truth][:4]
    exact = [[_box(o, c.scene, 0.9) for o in c.truth] for c in case_list]
    assert eval_scores.coco_ap(case_list, exact, "foveal")["ap"] == pytest.approx(1.0)
    # one false box per case beside the true ones: ranked last, it costs nothing; first, it costs precision
    wrong = [[_box(c.truth[0], c.scene, 0.0, shift=0.5)] for c in case_list]
    good = [w + [dict(b, score=0.9) for b in e] for w, e in zip(wrong, exact, strict=True)]
    bad = [
        [dict(w[0], score=1.0)] + [dict(b, score=0.1) for b in e] for w, e in zip(wrong, exact, strict=True)
    ]
    assert eval_scores.coco_ap(case_list, good, "foveal")["ap50"] == pytest.approx(1.0)
    assert eval_scores.coco_ap(case_list, bad, "foveal")["ap50"] < 0.9
    assert eval_scores.coco_ap(case_list, bad, "constant")["ap50"] < 0.9  # constant: the answer's own order


def test_a_small_run_reports_every_ranking_and_writes_the_plot(tmp_path):
    plot = tmp_path / "pr.png"
    metrics = eval_shapes.main(
        ["--scores", "--n", "3", "--plot", str(plot), "--json", str(tmp_path / "m.json")]
    )
    assert metrics is None  # eval_shapes' main prints; the metrics are in the file
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["cases"] == 6 and saved["absent_cases"] == 3
    for ranking in eval_scores.RANKINGS:
        assert 0.0 <= saved[f"ap_{ranking}"] <= saved[f"ap50_{ranking}"] <= 1.0
    assert saved["auc_constant"] in (0.5, None)  # one score for all: no ranking
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_refcoco_accuracy_is_the_share_of_top_scored_boxes_at_iou_half(tmp_path):
    import foveal

    rows = []
    with foveal.load() as model:
        for seed in range(3):
            scene = scenes.generate_scene(seed, 96)
            path = tmp_path / f"{seed}.png"
            scenes.render(scene).save(path)
            found = model.detect(path, "shape")["objects"]
            top = max(found, key=lambda o: o["score"])
            box = [top["x_min"] * 96, top["y_min"] * 96, top["x_max"] * 96, top["y_max"] * 96]
            if seed == 2:  # a box far from every answer: a miss
                box = (
                    [0.0, 0.0, 1.0, 1.0]
                    if top["x_min"] > 0.1 or top["y_min"] > 0.1
                    else [94.0, 94.0, 96.0, 96.0]
                )
            rows.append({"image": path.name, "phrase": "shape", "box": box})
    data = tmp_path / "refs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = eval_refcoco.main([str(data), "--device", "cpu"])
    assert metrics["expressions"] == 3
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert [p["iou"] >= 0.5 for p in metrics["predictions"]] == [True, True, False]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"image": "a.png", "phrase": "cat"}', "expected"),
        ('{"image": "a.png", "phrase": "cat", "box": [5, 5, 1, 9]}', "x_min < x_max"),
        ("not json", "expected"),
    ],
)
def test_refcoco_refuses_a_bad_line_naming_it(tmp_path, line, message):
    data = tmp_path / "refs.jsonl"
    data.write_text(line + "\n")
    with pytest.raises(ValueError, match=rf"refs.jsonl:1: .*{message}"):
        eval_refcoco.read_rows(data)
