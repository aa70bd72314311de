"""Referring-expression accuracy (RefCOCO-style) of any checkpoint on local data: `python -m foveal.training.eval_refcoco DATA.jsonl`.

Each line of the JSONL file is one expression:

    {"image": "images/0001.jpg", "phrase": "the man in the red shirt", "box": [x_min, y_min, x_max, y_max]}

`image` is a path (relative paths are read from the JSONL file's folder), `box` the ground truth in
pixels of that image (a COCO `[x, y, w, h]` box is `[x, y, x + w, y + h]`). The model detects the
phrase (`model.detect`, greedy, grammar-constrained); its prediction is the highest-scored box of the
answer (every box carries a "score", docs/scores.md), so a model that answers several boxes is judged
by the one it is surest of. Accuracy is the share of expressions whose prediction has IoU >= 0.5 with
the ground truth (no box answered: a miss), the measure RefCOCO papers report.
Nothing is downloaded: point it at data you have (RefCOCO's own files, converted to these lines).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from PIL import Image

from foveal.training.eval_scores import box_iou


def read_rows(path: str | Path) -> list[dict]:
    """The expressions of a JSONL file, checked; ValueError naming the line that is wrong."""
    path = Path(path)
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            image, phrase, box = row["image"], row["phrase"], [float(v) for v in row["box"]]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f'{path}:{number}: expected {{"image": path, "phrase": text, "box": [x_min, y_min, x_max, y_max]}} '
                f"({type(error).__name__}: {error})"
            ) from None
        if len(box) != 4 or box[2] <= box[0] or box[3] <= box[1]:
            raise ValueError(
                f"{path}:{number}: box {box} must be [x_min, y_min, x_max, y_max] with x_min < x_max, y_min < y_max"
            )
        rows.append({"image": path.parent / image, "phrase": phrase, "box": box})
    if not rows:
        raise ValueError(f"{path} holds no expressions")
    return rows


def evaluate(model, rows: list[dict]) -> dict:
    """Accuracy at IoU 0.5 of the top-scored box per expression, and what each prediction was."""
    predictions: list[dict | None]
    hits, missing, predictions = 0, 0, []
    for row in rows:
        with Image.open(row["image"]) as picture:
            image = picture.convert("RGB")
        width, height = image.size
        objects = model.detect(image, row["phrase"])["objects"]
        if not objects:
            missing += 1
            predictions.append(None)
            continue
        best = max(objects, key=lambda o: o["score"])
        box = (best["x_min"] * width, best["y_min"] * height, best["x_max"] * width, best["y_max"] * height)
        iou = box_iou(box, tuple(row["box"]))
        hits += iou >= 0.5
        predictions.append({"box": list(box), "score": best["score"], "iou": iou})
    return {
        "expressions": len(rows),
        "accuracy": hits / len(rows),
        "no_box": missing,
        "predictions": predictions,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m foveal.training.eval_refcoco", description=__doc__.split("\n")[0]
    )
    p.add_argument("data", help="JSONL file of {image, phrase, box} lines")
    p.add_argument(
        "--model", default=None, help="checkpoint folder or cached hub id (default: the embedded model)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="write the metrics and predictions here")
    args = p.parse_args(argv)
    import foveal

    rows = read_rows(args.data)
    t0 = time.time()
    with foveal.load(args.model, device=args.device) as model:
        metrics = evaluate(model, rows)
    metrics.update(model=args.model or "embedded", data=str(args.data), seconds=round(time.time() - t0, 1))
    print(
        f"model: {metrics['model']}\n{metrics['expressions']} expressions, accuracy@0.5 {metrics['accuracy']:.3f} "
        f"({metrics['no_box']} answered no box)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


if __name__ == "__main__":
    main()
