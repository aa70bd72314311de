"""Parity with transformers: drive a runner greedily as the engine does, and compare with `generate`.

`greedy(runner, prompts, n)` runs one varlen prefill launch for all prompts, then one batched decode
launch per step, with KV pages handed out in a shuffled order so that sequences' pages interleave
in the pool. `compare(loaded, reference, prompts)` runs it next to transformers' own `generate` on
each prompt alone and returns (max |logit difference|, all greedy tokens equal): the test of every
supported family (tests/models, benchmarks/models.py, benchmarks/device_check_models.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from foveal.engine.models.processor import PromptInputs
from foveal.engine.request import PrefillInputs
from foveal.engine.runner import ForwardBatch


@dataclass(slots=True)
class GreedyResult:
    tokens: list[list[int]]
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # per sequence, per step: [vocab]

    def logits_close(self, other: GreedyResult, atol: float = 1e-5) -> bool:
        """Every step's logits of every sequence within `atol` of `other`'s (same shapes required)."""
        return all(
            torch.allclose(x, y, atol=atol)
            for mine, theirs in zip(self.logits, other.logits, strict=True)
            for x, y in zip(mine, theirs, strict=True)
        )


def make_batch(
    items: list[tuple[list[int], int, list[int], PrefillInputs | None]], page_size: int, device: Any
) -> ForwardBatch:
    """items: (query token ids, position of the first one, page table, prefill inputs) per sequence."""
    ids: list[int] = []
    pos: list[int] = []
    starts, ctx, slots = [0], [], []
    width = max(len(t) for _, _, t, _ in items)
    tables = []
    for query, start, table, _ in items:
        ids += query
        pos += range(start, start + len(query))
        starts.append(starts[-1] + len(query))
        ctx.append(start + len(query))
        slots += [table[p // page_size] * page_size + p % page_size for p in range(start, start + len(query))]
        tables.append(table + [-1] * (width - len(table)))
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=as_t(ids, torch.int64),
        positions=as_t(pos, torch.int64),
        query_start=as_t(starts, torch.int32),
        context_lens=as_t(ctx, torch.int32),
        block_tables=as_t(tables, torch.int32),
        kv_index=as_t(slots, torch.int64),
        max_query_len=max(len(q) for q, _, _, _ in items),
        max_context_len=max(ctx),
        prefill=[p for _, _, _, p in items] if any(p is not None for _, _, _, p in items) else [],
    )


def trace_in_launch(runner: Any) -> Any:
    """Make a CPU runner trace each new decode bucket inside the launch that meets it (no
    background tracer), so a test knows that every decode launch after the first is a replay."""
    from foveal.engine.models.traced import DecodeGraphs

    runner.decode_graphs = DecodeGraphs(runner._eager, getattr(runner, "model", None), background=False)
    return runner


def greedy(
    runner: Any, prompts: list[PromptInputs], max_new_tokens: int, eos_ids=(), page_size: int = 4
) -> GreedyResult:
    """Greedy decoding of all prompts together: one prefill launch, then one decode launch per step."""
    need = [math.ceil((len(p.token_ids) + max_new_tokens) / page_size) for p in prompts]
    pool = list(range(sum(need) + 2))
    random.Random(0).shuffle(pool)
    runner.allocate_kv(len(pool), page_size)
    tables, at = [], 0
    for n in need:
        tables.append(pool[at : at + n])
        at += n
    result = GreedyResult(tokens=[[] for _ in prompts], logits=[[] for _ in prompts])
    items = [(p.token_ids, 0, t, p.prefill) for p, t in zip(prompts, tables, strict=True)]
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        logits = runner.forward(make_batch(items, page_size, runner.device)).cpu()
        still: list[int] = []
        items_next: list[tuple[list[int], int, list[int], PrefillInputs | None]] = []
        for row, seq in enumerate(active):
            token = int(logits[row].argmax())
            result.tokens[seq].append(token)
            result.logits[seq].append(logits[row])
            if token in eos_ids or len(result.tokens[seq]) == max_new_tokens:
                continue
            still.append(seq)
            position = len(prompts[seq].token_ids) + len(result.tokens[seq]) - 1
            items_next.append(([token], position, tables[seq], None))
        active, items = still, items_next
        if not active:
            break
    return result


def reference_greedy(
    model: Any, prompt: PromptInputs, family: Any, max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own `generate` (greedy, batch of one) on the same prompt: tokens and per-step logits."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.token_ids], device=device)
    kwargs = {}
    if prompt.prefill is not None:
        kwargs = {key: prompt.prefill.image_tensors[key].to(device) for key in family.image_keys}
        if "mm_token_type_ids" in prompt.prefill.image_tensors:  # Qwen-VL: what its rope index reads
            kwargs["mm_token_type_ids"] = prompt.prefill.image_tensors["mm_token_type_ids"].to(device)
        if family.prefix_attention:
            prefix = prompt.prefill.prefix_len
            kwargs["token_type_ids"] = torch.tensor([[0] * prefix + [1] * (len(prompt.token_ids) - prefix)], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return tokens, [step[0].float().cpu() for step in out.logits]


def reference_engine_tokens(loaded: Any, folder: Path, prompts: list[PromptInputs], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt as the engine returns them: without the EOS."""
    reference = reference_model(folder)
    family = loaded.runner.arch
    return [
        [t for t in reference_greedy(reference, p, family, max_new_tokens)[0] if t not in loaded.eos_token_ids]
        for p in prompts
    ]


def compare(
    loaded: Any, reference_model: Any, prompts: list[PromptInputs], max_new_tokens: int = 8
) -> tuple[float, bool]:
    """(max |logit difference| over all steps and prompts, all greedy tokens equal) of foveal vs transformers."""
    family = loaded.runner.arch
    ours = greedy(loaded.runner, prompts, max_new_tokens, loaded.eos_token_ids)
    expected = [reference_greedy(reference_model, prompt, family, max_new_tokens) for prompt in prompts]
    return against(ours, expected, max_new_tokens)


def against(
    ours: GreedyResult, expected: list[tuple[list[int], list[torch.Tensor]]], steps: int
) -> tuple[float, bool]:
    """(max |logit difference|, greedy tokens equal) of `ours` against the reference's (tokens, per-step
    logits) of each prompt, over the first `steps` steps. Where our logits are wider than the
    reference's (ids past its LM head, such as image-token ids), those columns must be -inf."""
    worst, equal = 0.0, True
    for seq, (tokens, logits) in enumerate(expected):
        equal &= tokens[:steps] == ours.tokens[seq]
        for a, b in zip(ours.logits[seq], logits, strict=False):
            if not torch.all(a[b.shape[0] :] == float("-inf")):
                raise AssertionError(f"prompt {seq}: logits past the reference's {b.shape[0]} columns are not -inf")
            worst = max(worst, float((a[: b.shape[0]] - b).abs().max()))
    return worst, equal


@dataclass(slots=True)
class EngineRounds:
    """Token ids of three engine rounds over the same prompts (see `engine_rounds`), and its cache state."""

    first: list[list[int]]
    again: list[list[int]]
    prefix_hit_rate: float
    free_pages: int


def engine_rounds(runner: Any, tokenizer: Any, prompts: list[PromptInputs], config: Any, max_new: int) -> EngineRounds:
    """Greedy `max_new` tokens of each prompt through an Engine: once as given, then twice with each
    image keyed (`image_key` "k<i>"), so the last round reads the prefix cache's pages and the image
    cache. `free_pages` is counted once the engine is idle."""
    from foveal.engine import Engine, Request, SamplingParams

    def keyed(prefill: PrefillInputs | None, key: str) -> PrefillInputs | None:
        return None if prefill is None else replace(prefill, image_key=key)

    with Engine(runner, tokenizer, config) as engine:
        plain = [Request(p.token_ids, SamplingParams(max_tokens=max_new), prefill=p.prefill) for p in prompts]
        first = engine.generate(plain, timeout=60)
        again = [
            Request(p.token_ids, SamplingParams(max_tokens=max_new), prefill=keyed(p.prefill, f"k{i}"))
            for i, p in enumerate(prompts)
        ]
        engine.generate(again, timeout=60)
        last = engine.generate(again, timeout=60)
        hit_rate = engine.stats()["prefix_hit_rate"]
        engine.wait_idle(10)
        free = engine.free_pages()
        sliding = engine.pipeline.sliding  # the sliding-window pool (engine/sliding.py): all back too
        if sliding is not None and not sliding.idle:
            raise AssertionError(f"sliding pages not all back at idle: {sliding.pool.num_free} of {sliding.pool.num_pages}")
    return EngineRounds([o.token_ids for o in first], [o.token_ids for o in last], hit_rate, free)


def reference_model(folder: Path) -> Any:
    """transformers' own model class for the folder, with its default (SDPA) attention."""
    config = tf.AutoConfig.from_pretrained(folder)
    return getattr(tf, config.architectures[0]).from_pretrained(folder).eval()
