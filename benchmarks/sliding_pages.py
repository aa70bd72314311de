"""Sliding-window pages: the KV memory a Gemma 4 sequence holds with the sliding layers' own pool.

    python -m benchmarks.sliding_pages [--budget-gib 8] [--out out/benchmarks/sliding_pages.json]

Two parts:
- sizes: for transformers' default Gemma4TextConfig (30 layers, 25 of them sliding with a window of
  512 positions, bf16 K/V) and foveal's KV layout of it (families/gemma4), what `limits.resolve`
  gives for a KV budget at several context lengths: pages of the full-attention tensors and of the
  sliding pool, how many whole sequences of max_model_len fit, and the KV bytes one full-length
  sequence holds, beside the same with every sliding page kept (one pool for all layers, as before);
- measured: the tiny random Gemma 4 (foveal.testing.tiny_gemma4, window 8) through the engine on a
  long text prompt, the most sliding pages the sequence held at once (sampled at every launch) beside
  the pages its context spans, and whether its greedy tokens equal those of a run whose sliding pool
  is as large as the main one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from foveal.engine import Engine, EngineConfig, Request, SamplingParams, limits
from foveal.engine.kv_cache import pages_needed
from foveal.engine.pipeline import DECODE_SPAN
from foveal.engine.sliding import SlidingPages, hold_pages


@dataclass
class _Sizes:
    """What limits.resolve reads of a runner: the real layout's bytes, no model."""

    kv: int
    sliding: int
    sliding_window: int | None
    max_positions: int | None = None
    device: torch.device = torch.device("cpu")

    def kv_bytes_per_token(self) -> int:
        return self.kv

    def sliding_kv_bytes_per_token(self) -> int:
        return self.sliding


def sizes(budget: int, lengths: tuple[int, ...]) -> list[dict]:
    import transformers

    from foveal.families.gemma4.model import kv_layout

    text = transformers.Gemma4TextConfig()
    layout = kv_layout(text)
    per_token = [2 * heads * dim * 2 for heads, dim in layout.shapes]  # K and V, bf16
    sliding = sum(per_token[i] for i in layout.sliding_tensors())
    rows = []
    for length in lengths:
        config = EngineConfig(max_batch=64, max_model_len=length, kv_cache_bytes=budget)
        with_pool = limits.resolve(config, _Sizes(sum(per_token), sliding, layout.sliding_window()))
        kept = limits.resolve(config, _Sizes(sum(per_token), 0, None))
        page = config.page_size
        per_sequence = pages_needed(length, page)
        # a text sequence of max_model_len positions (prefilled in chunks) holds at most this many
        held = hold_pages(length, length, False, page, layout.sliding_window(), with_pool.prefill_chunk, DECODE_SPAN)
        rows.append(
            {
                "max_model_len": length,
                "pages_kept": kept.num_pages,
                "sequences_kept": kept.num_pages // per_sequence,
                "pages_full": with_pool.num_pages,
                "pages_sliding": with_pool.sliding_pages,
                "sequences": min(with_pool.num_pages // per_sequence, with_pool.sliding_pages // held),
                "seq_bytes_kept": per_sequence * page * sum(per_token),
                "seq_bytes": per_sequence * page * (sum(per_token) - sliding) + held * page * sliding,
            }
        )
    return rows


def measured() -> dict:
    from foveal.families import load
    from foveal.testing import tiny_gemma4

    folder = tiny_gemma4.build_gemma4(Path(tempfile.mkdtemp()) / "tiny")
    family = load(folder, device="cpu")
    rendered = family.tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join(tiny_gemma4.PROMPTS * 4)}], tokenize=False, add_generation_prompt=True
    )
    prompt = family.processor(rendered, None, add_special_tokens=False).token_ids
    max_new = 48
    peak = {"held": 0}
    advance = SlidingPages.advance

    def counting(self, seq, first, last):
        advance(self, seq, first, last)
        peak["held"] = max(peak["held"], sum(1 for p in seq.sliding[seq.sliding_base :] if p >= 0))

    runs = {}
    for pages in (None, 1024):  # derived (the window's), then as large as the main pool: nothing passed is reused
        config = EngineConfig(
            page_size=4, num_pages=1024, max_model_len=512, prefill_chunk=16,
            sliding_pages=pages, eos_token_ids=(),
        )
        SlidingPages.advance = counting
        peak["held"] = 0
        try:
            with Engine(family.runner, family.tokenizer, config) as engine:
                out = engine.generate([Request(prompt, SamplingParams(max_tokens=max_new))], timeout=300)[0]
                runs[pages] = (out.token_ids, peak["held"], engine.config.sliding_pages)
        finally:
            SlidingPages.advance = advance
    tokens, held, pool = runs[None]
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": max_new,
        "window": tiny_gemma4.WINDOW,
        "context_pages": pages_needed(len(prompt) + max_new - 1, 4),
        "sliding_pages_held_at_most": held,
        "sliding_pool_pages": pool,
        "tokens_equal_to_a_pool_as_large_as_the_main_one": tokens == runs[1024][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--out", default="out/benchmarks/sliding_pages.json")
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    rows = sizes(budget, (4096, 8192, 16384))
    print(f"Gemma4TextConfig() defaults, bf16 K/V, a {args.budget_gib:g} GiB KV budget, max_batch 64")
    print(f"{'max_model_len':>13} {'seqs kept':>9} {'seqs now':>9} {'MiB/seq kept':>12} {'MiB/seq now':>11} {'ratio':>6}")
    for row in rows:
        kept, now = row["seq_bytes_kept"] / 2**20, row["seq_bytes"] / 2**20
        print(
            f"{row['max_model_len']:>13} {row['sequences_kept']:>9} {row['sequences']:>9} "
            f"{kept:>12.0f} {now:>11.0f} {now / kept:>6.2f}"
        )
    run = measured()
    print(
        f"tiny Gemma 4 (window {run['window']}): a {run['prompt_tokens']}-token prompt + {run['new_tokens']} tokens "
        f"span {run['context_pages']} pages; its sliding layers held at most {run['sliding_pages_held_at_most']} "
        f"(pool of {run['sliding_pool_pages']}); tokens equal: {run['tokens_equal_to_a_pool_as_large_as_the_main_one']}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"budget_bytes": budget, "sizes": rows, "measured": run}, indent=1))


if __name__ == "__main__":
    main()
