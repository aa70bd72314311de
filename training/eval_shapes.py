"""Evaluate a shapes model on held-out scenes: `python -m foveal.training.eval_shapes [--n 500] [--json out.json]`.

Metrics (one task of each kind per scene; scene seeds start at --seed-offset, default 0, which is
disjoint from training: training draws seeds >= train_shapes.TRAIN_SEED_BASE):
- detect precision / recall at IoU 0.5 (one-to-one greedy matching by IoU), mean IoU (over
  ground-truth boxes, 0 for a missed one);
- point hit rate (ground-truth objects that get a distinct predicted point inside the shape itself)
  and point precision (predicted points inside a distinct matching object);
- caption exact match per length (normal is the bar);
- query accuracy (exact match; question kinds rotate: count, color, shape, relation).

Decoding (--engine, printed with the table): "transformers" (default) is greedy through
transformers' `PaliGemmaForConditionalGeneration.generate` and its PaliGemmaProcessor, free text
parsed back by `shapes_format`; "foveal" runs the SDK (`foveal.load(folder)`, the project's engine,
detect/point constrained by the spatial grammars).

`--scores` runs the evaluation of detection scores instead (COCO AP with foveal's scores against
constant and area-only scores on harder scenes, ROC AUC, a precision / recall plot): the options
are `foveal.training.eval_scores`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from foveal.families.shapes.format import ShapesFormat
from foveal.vision import scenes

ENGINES = {
    "transformers": "transformers generate, greedy, unconstrained",
    "foveal": "foveal.load: the project's engine, greedy, grammar-constrained detect/point",
}
DEFAULT_MODEL = Path(__file__).parent / "embedded"
QUERY_KINDS = ("count", "color", "shape", "relation")


def eval_scene(seed: int) -> scenes.Scene:
    """Held-out scene of a seed; its size (64..160 px, sometimes not square) follows from the seed."""
    rng = np.random.default_rng([seed, 2])
    width = int(rng.integers(64, 161))
    height = width if rng.random() < 0.8 else max(32, round(width * rng.uniform(0.7, 1.4)))
    return scenes.generate_scene(seed, width, height)


def eval_tasks(scene: scenes.Scene, i: int) -> dict[str, str]:
    """The object phrase and question asked of scene number i (deterministic, kinds rotate)."""
    rng = np.random.default_rng([scene.seed, 3])
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    phrase = ("shape", obj.shape, obj.phrase())[i % 3]
    pairs = scenes.questions(scene)
    kinds = [k for k in QUERY_KINDS if pairs[k]]
    kind = kinds[i % len(kinds)]
    options = pairs[kind]
    if kind == "count":
        options = [(q, a) for q, a in options if a != "0"] if i % 2 else options
    question, answer = options[int(rng.integers(len(options)))]
    return {"phrase": phrase, "question": question, "answer": answer}


def iou(a: dict[str, float], b: tuple[float, float, float, float]) -> float:
    ix = max(0.0, min(a["x_max"], b[2]) - max(a["x_min"], b[0]))
    iy = max(0.0, min(a["y_max"], b[3]) - max(a["y_min"], b[1]))
    inter = ix * iy
    area_a = max(0.0, a["x_max"] - a["x_min"]) * max(0.0, a["y_max"] - a["y_min"])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    return inter / (area_a + area_b - inter) if inter > 0 else 0.0


def match_boxes(pred: list[dict[str, float]], truth: list[tuple]) -> tuple[int, list[float]]:
    """Greedy one-to-one matching by IoU: (#matches at IoU >= 0.5, IoU per ground-truth box)."""
    pairs = sorted(((iou(p, t), i, j) for i, p in enumerate(pred) for j, t in enumerate(truth)), reverse=True)
    used_p, best = set(), [0.0] * len(truth)
    used_t: set[int] = set()
    for v, i, j in pairs:
        if i not in used_p and j not in used_t and v > 0:
            used_p.add(i)
            used_t.add(j)
            best[j] = v
    return sum(v >= 0.5 for v in best), best


def match_points(pred: list[dict[str, float]], objs: list[scenes.SceneObject], scene: scenes.Scene) -> int:
    """Distinct objects hit by distinct points (greedy in order)."""
    used: set[int] = set()
    for p in pred:
        for j, o in enumerate(objs):
            if j not in used and o.contains(p["x"], p["y"], scene.width, scene.height):
                used.add(j)
                break
    return len(used)


class Generator:
    """Batched greedy decoding of a Hugging Face PaliGemma folder through transformers."""

    def __init__(self, folder: str | Path, batch_size: int = 64):
        from transformers import PaliGemmaForConditionalGeneration, PaliGemmaProcessor

        self.processor = PaliGemmaProcessor.from_pretrained(folder)
        self.processor.tokenizer.padding_side = "left"
        self.model = PaliGemmaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.batch_size = batch_size

    @torch.inference_mode()
    def __call__(self, images: list, prompts: list[str], max_new_tokens: int) -> list[str]:
        out: list[str] = []
        for s in range(0, len(prompts), self.batch_size):
            inputs = self.processor(
                images=images[s : s + self.batch_size],
                text=["<image>" + p for p in prompts[s : s + self.batch_size]],
                padding="longest",
                return_tensors="pt",
            )
            ids = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            new = ids[:, inputs["input_ids"].shape[1] :]
            out += self.processor.tokenizer.batch_decode(new, skip_special_tokens=True)
        return out


def evaluate_model(
    folder: str | Path,
    n: int = 500,
    seed_offset: int = 0,
    details: bool = False,
    engine: str = "transformers",
) -> dict:
    """Metrics of the model in `folder` on n held-out scenes; engine "transformers" (greedy, free text)
    or "foveal" (foveal.load: the project's engine, grammar-constrained)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; use one of {', '.join(ENGINES)}")
    fmt = ShapesFormat.load(folder)
    scene_list = [eval_scene(seed_offset + i) for i in range(n)]
    tasks = [eval_tasks(s, i) for i, s in enumerate(scene_list)]
    images = [scenes.render(s) for s in scene_list]
    answer = answers_transformers if engine == "transformers" else answers_foveal
    said = answer(folder, fmt, images, tasks)
    metrics = score(scene_list, tasks, said)
    if details:
        metrics["examples"] = [
            {"seed": s.seed, **t, **{k: v[i] for k, v in said.items()}}
            for i, (s, t) in enumerate(zip(scene_list, tasks, strict=True))
        ][:20]
    return metrics


def answers_transformers(folder: str | Path, fmt: ShapesFormat, images: list, tasks: list[dict]) -> dict:
    gen = Generator(folder)
    phrases = [t["phrase"] for t in tasks]
    said = {
        "detect": [
            fmt.parse_detect(t) for t in gen(images, [fmt.prompt("detect", object=p) for p in phrases], 48)
        ],
        "point": [
            fmt.parse_point(t) for t in gen(images, [fmt.prompt("point", object=p) for p in phrases], 32)
        ],
        "query": gen(images, [fmt.prompt("query", question=t["question"]) for t in tasks], 8),
    }
    for length in ("short", "normal", "long"):
        said[f"caption_{length}"] = gen(images, [fmt.prompt("caption", length=length)] * len(images), 64)
    return said


def answers_foveal(folder: str | Path, fmt: ShapesFormat, images: list, tasks: list[dict]) -> dict:
    import foveal

    with foveal.load(folder) as model:
        phrases = [t["phrase"] for t in tasks]
        said = {
            "detect": [r["objects"] for r in _mapped(model, "detect", images, phrases)],
            "point": [r["points"] for r in _mapped(model, "point", images, phrases)],
            "query": [r["answer"] for r in _mapped(model, "query", images, [t["question"] for t in tasks])],
        }
        for length in ("short", "normal", "long"):
            said[f"caption_{length}"] = [
                r["caption"] for r in _mapped(model, "caption", images, [length] * len(images))
            ]
    return said


def _mapped(model, skill: str, images: list, args: list[str]) -> list:
    """`model.map` per distinct argument (it takes one argument for all its images), in input order."""
    out: list = [None] * len(images)
    for arg in dict.fromkeys(args):
        rows = [i for i, a in enumerate(args) if a == arg]
        for i, result in zip(
            rows, model.map(skill, [images[i] for i in rows], arg, progress=False), strict=True
        ):
            if isinstance(result, Exception):
                raise result
            out[i] = result
    return out


def score(scene_list: list, tasks: list[dict], said: dict[str, list]) -> dict:
    tp = n_pred = n_true = hits = n_points = p_hits = 0
    ious: list[float] = []
    for i, (scene, task) in enumerate(zip(scene_list, tasks, strict=True)):
        objs = scenes.objects_matching(scene, task["phrase"])
        truth = [o.box(scene.width, scene.height) for o in objs]
        boxes = said["detect"][i]
        matched, best = match_boxes(boxes, truth)
        tp, n_pred, n_true = tp + matched, n_pred + len(boxes), n_true + len(truth)
        ious += best
        points = said["point"][i]
        hit = match_points(points, objs, scene)
        hits, n_points, p_hits = hits + hit, n_points + len(points), p_hits + hit
    metrics = {
        "n_scenes": len(scene_list),
        "detect_precision": tp / max(1, n_pred),
        "detect_recall": tp / max(1, n_true),
        "detect_mean_iou": float(np.mean(ious)) if ious else 0.0,
        "point_hit_rate": hits / max(1, n_true),
        "point_precision": p_hits / max(1, n_points),
        "query_accuracy": float(
            np.mean([t.strip() == k["answer"] for t, k in zip(said["query"], tasks, strict=True)])
        ),
    }
    for length in ("short", "normal", "long"):
        captions = [scenes.caption(s, length) for s in scene_list]
        exact = [a.strip() == b for a, b in zip(said[f"caption_{length}"], captions, strict=True)]
        metrics[f"caption_{length}_exact"] = float(np.mean(exact))
    return metrics


BARS = {
    "detect_precision": 0.90,
    "detect_recall": 0.90,
    "point_hit_rate": 0.90,
    "caption_normal_exact": 0.80,
    "query_accuracy": 0.80,
}


def format_table(metrics: dict) -> str:
    rows = ["| metric | value | bar |", "|---|---|---|"]
    for k, v in metrics.items():
        if isinstance(v, float):
            bar = f">= {BARS[k]:.2f}" if k in BARS else ""
            rows.append(f"| {k} | {v:.3f} | {bar} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--scores" in argv:  # the score evaluation: its own options (eval_scores.py)
        from foveal.training import eval_scores

        eval_scores.main([a for a in argv if a != "--scores"])
        return
    p = argparse.ArgumentParser(
        prog="python -m foveal.training.eval_shapes", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face folder of a shapes model")
    p.add_argument("--n", type=int, default=500, help="number of held-out scenes")
    p.add_argument("--seed-offset", type=int, default=0, help="first held-out scene seed")
    p.add_argument("--json", default=None, help="write the metrics here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", choices=list(ENGINES), default="transformers", help="how to decode")
    args = p.parse_args(argv)
    if not (Path(args.model) / "model.safetensors").is_file():
        raise SystemExit(
            f"no model weights in {args.model}; train and export one with python -m foveal.training.train_shapes --export {args.model}"
        )
    torch.set_num_threads(args.threads)
    t0 = time.time()
    metrics = evaluate_model(args.model, n=args.n, seed_offset=args.seed_offset, engine=args.engine)
    decoder = ENGINES[args.engine]
    metrics.update(model=str(args.model), decoder=decoder, seconds=round(time.time() - t0, 1))
    print(f"decoder: {decoder}\nmodel: {args.model}\n")
    print(format_table(metrics))
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
