"""Do detection scores rank? COCO AP with foveal's scores against constant and area-only scores, on hard scenes.

`python -m foveal.training.eval_scores [--model DIR] [--n 300] [--plot pr.png] [--json out.json]`
(also `python -m foveal.training.eval_shapes --scores`).

PROBLEM
    A VLM's boxes come without confidences; an evaluation that sets every score to 1.0 measures the
    order the model happened to write its boxes in, not how well a threshold separates good boxes
    from bad ones. foveal scores every box (foveal.families.scores); whether the scores mean
    something is measured here, on scenes harder than the training world, where the model makes
    mistakes to rank.
SOLUTION
    Held-out scenes (`hard_scene(seed)`: 4 to 8 objects, sides from 6% of the shorter image side,
    boxes that may overlap, seeds disjoint from training's), two phrases each: one that matches
    some objects and one that matches none (every box answered for it is a false positive). The
    model detects (and points) through `foveal.load`, greedy, grammar-constrained, and the same
    detections are scored three ways:
    - foveal: the answer's own "score";
    - constant: 1.0 for every box (what an evaluation without scores measures);
    - area: the box's area alone (this model's false positives are mostly small boxes, so size
      already ranks them somewhat: a confidence must carry more than that).
    Reported: COCO AP@[.5:.95] and AP@.5 (pycocotools, one category, each (scene, phrase) an image),
    ROC AUC of true against false positives (a box is true when a one-to-one matching by IoU,
    which does not look at scores, gives it a ground-truth box at IoU >= 0.5; points: inside a
    distinct matching object), and a precision / recall plot at IoU 0.5 (matplotlib).
INVARIANTS (tests/training/test_eval_scores.py)
    - Scenes are a function of their seed; objects stay visible (no box inside another, overlap
      bounded); absent phrases match no object.
    - The three rankings score the very same detections.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from foveal.vision import scenes

SEED_BASE = 7_000_000  # below train_shapes.TRAIN_SEED_BASE, away from eval_shapes' 0..n
MIN_OBJECTS, MAX_OBJECTS = 4, 8
MIN_SIZE, MAX_SIZE = 0.06, 0.35  # of the shorter side
MAX_OVERLAP = 0.3  # IoU between two objects' boxes
RANKINGS = ("foveal", "constant", "area")


@dataclass(frozen=True, slots=True)
class Case:
    """One question of the evaluation: a scene and an object phrase (absent: no object matches it)."""

    scene: scenes.Scene
    phrase: str

    @property
    def truth(self) -> list[scenes.SceneObject]:
        return scenes.objects_matching(self.scene, self.phrase)


def hard_scene(seed: int) -> scenes.Scene:
    """A scene of 4-8 objects, small ones among them, boxes that may overlap (never one inside another)."""
    rng = np.random.default_rng([seed, 11])
    width = int(rng.integers(64, 161))
    height = width if rng.random() < 0.8 else max(32, round(width * rng.uniform(0.7, 1.4)))
    side = min(width, height)
    lo, hi = max(3, int(np.ceil(MIN_SIZE * side))), int(np.floor(MAX_SIZE * side))
    placed: list[scenes.SceneObject] = []
    wanted = int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1))
    for _ in range(wanted * 40):
        if len(placed) == wanted:
            break
        size = int(rng.integers(lo, hi + 1))
        x0, y0 = int(rng.integers(0, width - size + 1)), int(rng.integers(0, height - size + 1))
        shape = scenes.SHAPES[int(rng.integers(len(scenes.SHAPES)))]
        colour = list(scenes.COLOURS)[int(rng.integers(len(scenes.COLOURS)))]
        obj = scenes.SceneObject(shape, colour, x0, y0, x0 + size, y0 + size)
        if all(_visible_beside(obj, other) for other in placed):
            placed.append(obj)
    return scenes.Scene(seed, width, height, int(rng.integers(200, 256)), tuple(placed))


def _visible_beside(a: scenes.SceneObject, b: scenes.SceneObject) -> bool:
    box = lambda o: (o.x0, o.y0, o.x1, o.y1)  # noqa: E731
    inside = lambda p, q: p.x0 >= q.x0 and p.y0 >= q.y0 and p.x1 <= q.x1 and p.y1 <= q.y1  # noqa: E731
    return box_iou(box(a), box(b)) <= MAX_OVERLAP and not inside(a, b) and not inside(b, a)


def box_iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """IoU of two (x_min, y_min, x_max, y_max) boxes."""
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if inter > 0 else 0.0


def cases(n: int, seed_base: int = SEED_BASE) -> list[Case]:
    """Two cases per scene: a phrase some objects match, then one no object matches."""
    out = []
    for i in range(n):
        scene = hard_scene(seed_base + i)
        rng = np.random.default_rng([scene.seed, 12])
        obj = scene.objects[int(rng.integers(len(scene.objects)))]
        out.append(Case(scene, (obj.shape, obj.phrase(), "shape")[i % 3]))
        absent = [p for p in scenes.all_phrases() if not scenes.objects_matching(scene, p)]
        if absent:
            out.append(Case(scene, absent[int(rng.integers(len(absent)))]))
    return out


# ---- detections and what they are ------------------------------------------------------------------------------


def _as_box(item: dict) -> tuple[float, float, float, float]:
    return (item["x_min"], item["y_min"], item["x_max"], item["y_max"])


def true_positives(case: Case, boxes: list[dict]) -> list[bool]:
    """Whether each box gets its own ground-truth box at IoU >= 0.5 (greedy one-to-one by IoU, scores unseen)."""
    truth = [o.box(case.scene.width, case.scene.height) for o in case.truth]
    pairs = sorted(
        ((box_iou(_as_box(p), t), i, j) for i, p in enumerate(boxes) for j, t in enumerate(truth)),
        reverse=True,
    )
    hit, used = [False] * len(boxes), set()
    for value, i, j in pairs:
        if value >= 0.5 and not hit[i] and j not in used:
            hit[i] = True
            used.add(j)
    return hit


def point_hits(case: Case, points: list[dict]) -> list[bool]:
    """Whether each point falls inside a distinct matching object (in answer order)."""
    used, hits = set(), []
    for p in points:
        found = next(
            (
                j
                for j, o in enumerate(case.truth)
                if j not in used and o.contains(p["x"], p["y"], case.scene.width, case.scene.height)
            ),
            None,
        )
        hits.append(found is not None)
        if found is not None:
            used.add(found)
    return hits


def ranking_scores(boxes: list[dict], ranking: str) -> list[float]:
    if ranking == "foveal":
        return [b["score"] for b in boxes]
    if ranking == "constant":
        return [1.0] * len(boxes)
    return [(b["x_max"] - b["x_min"]) * (b["y_max"] - b["y_min"]) for b in boxes]


# ---- metrics ---------------------------------------------------------------------------------------------------


def roc_auc(positive: list[float], negative: list[float]) -> float | None:
    """P(a true positive's score > a false positive's), ties counting half (Mann-Whitney); None if a side is empty."""
    if not positive or not negative:
        return None
    values = np.asarray(positive + negative, dtype=np.float64)
    order = values.argsort(kind="mergesort")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):  # ties share their mean rank
        tied = values == v
        ranks[tied] = ranks[tied].mean()
    n_pos, n_neg = len(positive), len(negative)
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def coco_ap(case_list: list[Case], detections: list[list[dict]], ranking: str) -> dict:
    """COCO AP@[.5:.95], AP@.5 and the IoU-0.5 precision / recall curve of the detections under a ranking."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images: list[dict] = []
    annotations: list[dict] = []
    results: list[dict] = []
    for image_id, (case, boxes) in enumerate(zip(case_list, detections, strict=True), start=1):
        w, h = case.scene.width, case.scene.height
        images.append({"id": image_id, "width": w, "height": h})
        for o in case.truth:
            side = (o.x1 - o.x0) * (o.y1 - o.y0)
            bbox = [o.x0, o.y0, o.x1 - o.x0, o.y1 - o.y0]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": 1,
                    "bbox": bbox,
                    "area": side,
                    "iscrowd": 0,
                }
            )
        for box, score in zip(boxes, ranking_scores(boxes, ranking), strict=True):
            x0, y0, x1, y1 = box["x_min"] * w, box["y_min"] * h, box["x_max"] * w, box["y_max"] * h
            results.append(
                {"image_id": image_id, "category_id": 1, "bbox": [x0, y0, x1 - x0, y1 - y0], "score": score}
            )
    truth = COCO()
    truth.dataset = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": 1, "name": "object"}],
    }
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        truth.createIndex()
        found = truth.loadRes(results) if results else None
        if found is None:
            return {"ap": 0.0, "ap50": 0.0, "recall": [], "precision": []}
        evaluation = COCOeval(truth, found, "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    precision = evaluation.eval["precision"][0, :, 0, 0, -1]  # IoU 0.5, every recall, all areas, 100 dets
    recall = evaluation.params.recThrs
    keep = precision > 0  # pycocotools writes 0 at recalls the detections never reach
    return {
        "ap": float(evaluation.stats[0]),
        "ap50": float(evaluation.stats[1]),
        "recall": recall[keep].tolist(),
        "precision": precision[keep].tolist(),
    }


def score_metrics(case_list: list[Case], detections: list[list[dict]], points: list[list[dict]]) -> dict:
    """Every number of the report, from the cases and the model's scored boxes and points."""
    metrics: dict = {"cases": len(case_list), "absent_cases": sum(not c.truth for c in case_list)}
    metrics["boxes"] = sum(map(len, detections))
    labels = [
        t for case, boxes in zip(case_list, detections, strict=True) for t in true_positives(case, boxes)
    ]
    metrics["true_positives"] = sum(labels)
    metrics["ground_truth"] = sum(len(c.truth) for c in case_list)
    curves = {}
    for ranking in RANKINGS:
        ap = coco_ap(case_list, detections, ranking)
        curves[ranking] = (ap.pop("recall"), ap.pop("precision"))
        flat = [s for boxes in detections for s in ranking_scores(boxes, ranking)]
        metrics[f"ap_{ranking}"], metrics[f"ap50_{ranking}"] = ap["ap"], ap["ap50"]
        metrics[f"auc_{ranking}"] = roc_auc(
            [s for s, t in zip(flat, labels, strict=True) if t],
            [s for s, t in zip(flat, labels, strict=True) if not t],
        )
    hits = [
        (p["score"], h)
        for case, ps in zip(case_list, points, strict=True)
        for p, h in zip(ps, point_hits(case, ps), strict=True)
    ]
    metrics["points"] = len(hits)
    metrics["point_hits"] = sum(h for _, h in hits)
    metrics["auc_points_foveal"] = roc_auc([s for s, h in hits if h], [s for s, h in hits if not h])
    metrics["curves"] = curves
    return metrics


def plot_curves(curves: dict, path: str | Path, title: str) -> Path:
    """The IoU-0.5 precision / recall curves of the rankings, as an image file."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 4), dpi=120)
    for ranking, (recall, precision) in curves.items():
        axes.plot(recall, precision, label=f"{ranking} scores")
    axes.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02), title=title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return Path(path)


# ---- running the model -----------------------------------------------------------------------------------------


def answers(folder: str | Path, case_list: list[Case]) -> tuple[list[list[dict]], list[list[dict]]]:
    """The model's scored boxes and points for every case (foveal.load: greedy, grammar-constrained)."""
    import foveal

    images = {id(c.scene): scenes.render(c.scene) for c in case_list}
    detections: list = [None] * len(case_list)
    points: list = [None] * len(case_list)
    with foveal.load(folder) as model:
        for phrase in dict.fromkeys(c.phrase for c in case_list):
            rows = [i for i, c in enumerate(case_list) if c.phrase == phrase]
            pictures = [images[id(case_list[i].scene)] for i in rows]
            for skill, out, key in (("detect", detections, "objects"), ("point", points, "points")):
                for i, result in zip(rows, model.map(skill, pictures, phrase, progress=False), strict=True):
                    if isinstance(result, Exception):
                        raise result
                    out[i] = result[key]
    return detections, points


def format_table(metrics: dict) -> str:
    def cell(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    rows = ["| scores | AP@[.5:.95] | AP@.5 | ROC AUC (TP vs FP) |", "|---|---|---|---|"]
    for ranking in RANKINGS:
        rows.append(
            f"| {ranking} | {cell(metrics[f'ap_{ranking}'])} | {cell(metrics[f'ap50_{ranking}'])} "
            f"| {cell(metrics[f'auc_{ranking}'])} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m foveal.training.eval_scores", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model", default=None, help="folder of a model foveal.load takes (default: the embedded one)"
    )
    p.add_argument(
        "--n", type=int, default=300, help="hard scenes (two phrases each: one present, one absent)"
    )
    p.add_argument("--seed-base", type=int, default=SEED_BASE, help="first scene seed")
    p.add_argument("--plot", default="scores_pr.png", help="where to write the precision / recall plot")
    p.add_argument("--json", default=None, help="write the metrics here")
    args = p.parse_args(argv)
    t0 = time.time()
    case_list = cases(args.n, args.seed_base)
    detections, points = answers(args.model, case_list)
    metrics = score_metrics(case_list, detections, points)
    curves = metrics.pop("curves")
    plot = plot_curves(curves, args.plot, f"{args.n} hard scenes, IoU 0.5")
    metrics.update(model=args.model or "embedded", seconds=round(time.time() - t0, 1), plot=str(plot))
    print(
        f"model: {metrics['model']}\n{metrics['cases']} cases ({metrics['absent_cases']} with an absent phrase), "
        f"{metrics['boxes']} boxes, {metrics['true_positives']} true positives of {metrics['ground_truth']} objects\n"
    )
    print(format_table(metrics))
    print(
        f"\npoints: {metrics['points']}, {metrics['point_hits']} hits, ROC AUC of foveal scores "
        f"{'n/a' if metrics['auc_points_foveal'] is None else format(metrics['auc_points_foveal'], '.3f')}"
    )
    print(f"plot: {plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


if __name__ == "__main__":
    main()
