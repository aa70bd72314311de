"""The engine's sizes, resolved once from the runner: context length, KV pages, tokens per step.

PROBLEM
    How long a sequence may be, how many KV pages to allocate and how many query tokens a step may
    carry depend on the model (its positions, its K/V bytes per token) and on the machine (free
    memory). Computed in several places they drift apart, and a request is then accepted by one
    check and refused by another.
SOLUTION
    `EngineConfig` leaves these sizes (and the idle engine's admission window) None by default;
    `resolve(config, runner)` fills them from the runner once, with one set of defaults, and
    refuses a configuration that cannot run one full sequence. `check_request` is the only place a request's prompt and max_tokens are checked
    against those limits; the SDK only chooses max_tokens.
INVARIANTS
    - A resolved config has every size set: max_model_len <= the runner's positions (when known),
      max_step_tokens >= max_batch, and num_pages, when derived from a budget, holds at least one
      sequence of max_model_len tokens (an explicit num_pages is checked per request instead).
    - A request accepted by `check_request` can always be admitted once the pool is free: a text
      prompt of any length (it is prefilled in chunks), a prompt with an image only if it fits
      max_step_tokens (it is prefilled in one launch).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

import torch

from .config import EngineConfig
from .kv_cache import DEFAULT_PAGE_SIZE, pages_needed
from .pipeline import DECODE_SPAN
from .request import Request
from .runner import ModelRunner, SlidingWindow, sliding_window
from .sliding import hold_pages

DEFAULT_MAX_MODEL_LEN = 4096  # tokens per sequence unless the model allows fewer or the caller asks
DEFAULT_KV_FRACTION = 0.25  # of free device memory (CUDA) or available RAM (CPU)
# Query tokens a step may carry by default: with prompts of a few hundred tokens (an image's tokens
# and a question), a budget of one short context admits only a few prompts a step, so a stream of
# new requests never fills the batch; 2048 admits a batch's worth in a step or two (vLLM's default
# budget is of the same order).
DEFAULT_MAX_STEP_TOKENS = 2048
# A text prompt's tokens per launch (chunked prefill, scheduler.py): a long prompt then costs the
# decoding rows of the same steps a few short forwards instead of one long one.
DEFAULT_PREFILL_CHUNK = 512
# An idle engine's quiet window before its first launch (EngineConfig.admission_window_s; see _admission_window).
CPU_ADMISSION_WINDOW_S = 0.010
# Decode sub-steps a step of rows without grammar, logprobs or drafts may run (bursts.py): the
# per-step host work is paid once for them, and text streams that many tokens at a time.
# On an accelerator the pipeline already hides the host work behind the device's: there it is 1 (off).
CPU_DECODE_BURST = 8
ADMISSION_WINDOW_S = 0.002


def resolve(config: EngineConfig, runner: ModelRunner) -> EngineConfig:
    """A copy of `config` with every size the caller left None derived from the runner."""
    names = (
        "max_batch", "page_size", "max_model_len", "max_step_tokens", "num_pages", "kv_cache_bytes", "prefill_chunk",
        "sliding_pages", "decode_burst",
    )
    for name in names:
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    limit = runner.max_positions
    if config.max_model_len is not None and limit is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds this model's {limit} positions; lower it")
    model_len = config.max_model_len or min(limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    step_tokens = config.max_step_tokens or max(model_len, config.max_batch, DEFAULT_MAX_STEP_TOKENS)
    if step_tokens < config.max_batch:
        raise ValueError("max_step_tokens must be >= max_batch (each decode row is one token)")
    chunk = config.prefill_chunk or DEFAULT_PREFILL_CHUNK
    window = sliding_window(runner)
    if window is None and config.sliding_pages is not None:
        raise ValueError("sliding_pages is set, but this model has no sliding-window KV of its own; leave it None")
    holds = None if window is None else _sliding_holds(config, window, model_len, step_tokens, chunk)
    num_pages, sliding_pages = config.num_pages, config.sliding_pages
    if num_pages is None:
        num_pages, sliding_pages = _pages_from_budget(config, runner, model_len, holds)
    elif holds is not None and sliding_pages is None:
        sequences = min(config.max_batch, max(1, num_pages // pages_needed(model_len, config.page_size)))
        sliding_pages = min(num_pages, _windows_of(sequences, holds))
    return dataclasses.replace(
        config,
        max_model_len=model_len,
        max_step_tokens=step_tokens,
        num_pages=num_pages,
        sliding_pages=sliding_pages,
        prefill_chunk=chunk,
        decode_burst=config.decode_burst or (CPU_DECODE_BURST if runner.device.type == "cpu" else 1),
        admission_window_s=_admission_window(config.admission_window_s, runner.device),
    )


def _admission_window(window: float | None, device: torch.device) -> float:
    """The idle engine's quiet window (Engine._gather_arrivals). SDK calls made from many threads at
    once reach a CPU engine milliseconds apart (each is about a millisecond of Python under the
    GIL, and the threads contend): a 2 ms window let the first prefill take only a few of them, the
    answers ran out of step and took more steps and more wall time than with 10 ms, which gathers
    nearly all (benchmarks/llamacpp.py's 32-request workload). A lone call's first launch waits the
    window once: 10 ms is a small share of a JSON call on a CPU, while on an accelerator a launch is
    an order of magnitude shorter, so it keeps 2 ms."""
    if window is None:
        return CPU_ADMISSION_WINDOW_S if device.type == "cpu" else ADMISSION_WINDOW_S
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not window >= 0:
        raise ValueError(f"admission_window_s must be a number of seconds >= 0 (0: no wait), got {window!r}")
    return float(window)


def _sliding_holds(config: EngineConfig, window: int, model_len: int, step_tokens: int, chunk: int) -> tuple[int, int]:
    """Sliding-window pages (sliding.py) held at most by a text sequence of `model_len` positions
    (prefilled in chunks), and by any one sequence (a prompt with an image of up to max_step_tokens,
    prefilled in one launch)."""
    text = hold_pages(model_len, model_len, False, config.page_size, window, chunk, DECODE_SPAN)
    one = hold_pages(step_tokens, model_len, True, config.page_size, window, chunk, DECODE_SPAN)
    return text, max(text, one)


def _windows_of(sequences: int, holds: tuple[int, int]) -> int:
    """Sliding pages for the windows of `sequences` text sequences, and never fewer than one
    sequence can hold (`_sliding_holds`)."""
    return max(holds[1], sequences * holds[0])


def _pages_from_budget(
    config: EngineConfig, runner: ModelRunner, model_len: int, holds: tuple[int, int] | None
) -> tuple[int, int | None]:
    """(pages, sliding pages): pages for `max_batch` sequences of `model_len` tokens, or what the
    budget holds if less (at least one whole sequence: a smaller cache could never run a long
    request). With a sliding-window pool (`holds`: `_sliding_holds`), a sequence costs its pages of
    the other tensors and only its window's of the sliding ones: the budget is split for as many
    such sequences as it holds (up to max_batch), and what the sliding pool leaves goes to pages."""
    budget = config.kv_cache_bytes or default_budget_bytes(runner.device)
    page_size = config.page_size
    per_sequence = pages_needed(model_len, page_size)
    most = config.max_batch * per_sequence
    pages = min(most, pages_for_budget(runner, budget, page_size))
    sliding = None
    if holds is not None:
        # holds: the runner has a sliding window
        sliding_page = cast(SlidingWindow, runner).sliding_kv_bytes_per_token() * page_size
        full_page = runner.kv_bytes_per_token() * page_size - sliding_page
        sliding = config.sliding_pages
        if sliding is None:
            sequences = min(config.max_batch, budget // (per_sequence * full_page + holds[0] * sliding_page))
            sliding = _windows_of(sequences, holds)
        if sliding < pages:  # fewer sliding pages than pages: the bytes they leave are more pages
            pages = min(most, (budget - sliding * sliding_page) // full_page if full_page else most)
        sliding = min(sliding, pages) if config.sliding_pages is None else sliding
    if pages < per_sequence:
        raise ValueError(
            f"a KV cache of {budget} bytes holds {pages} pages of {page_size} tokens; one sequence of "
            f"{model_len} tokens needs {per_sequence}: raise kv_cache_bytes or lower max_model_len"
        )
    return pages, sliding


def pages_for_budget(runner: ModelRunner, budget_bytes: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """How many pages of `page_size` tokens fit in `budget_bytes`; raises when not even one does."""
    page_bytes = runner.kv_bytes_per_token() * page_size
    pages = budget_bytes // page_bytes
    if pages < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no page of {page_size} tokens ({page_bytes} bytes); raise it"
        )
    return int(pages)


def default_budget_bytes(device: torch.device, fraction: float = DEFAULT_KV_FRACTION) -> int:
    """A default KV budget: `fraction` of the device's free memory (CUDA) or of available RAM (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction)


def check_request(
    request: Request, config: EngineConfig, vocab_size: int, tokenizer: Any, window: int | None = None
) -> None:
    """Raise ValueError, with what to change, for a request this engine can never run (`window`:
    the runner's sliding window, runner.SlidingWindow)."""
    prompt_len, max_tokens = len(request.prompt_ids), request.sampling.max_tokens
    context = config.max_model_len
    # the engine's config, resolved (`resolve`): every size is set
    assert context is not None and config.max_step_tokens is not None and config.num_pages is not None
    assert config.prefill_chunk is not None
    if prompt_len == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. the BOS id)")
    if prompt_len >= context:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, no room in this engine's context of {context} "
            "(max_model_len); shorten it or load with a larger max_model_len"
        )
    if request.prefill is not None and prompt_len > config.max_step_tokens:  # text prompts are chunked
        raise ValueError(
            f"the prompt has {prompt_len} tokens with an image, which is prefilled in one step, more than "
            f"max_step_tokens={config.max_step_tokens}; raise it"
        )
    if prompt_len + max_tokens > context:
        raise ValueError(
            f"max_tokens={max_tokens} does not fit: the prompt has {prompt_len} tokens and the context is "
            f"{context} (max_model_len); use max_tokens <= {context - prompt_len}"
        )
    if pages_needed(prompt_len + max_tokens - 1, config.page_size) > config.num_pages:
        raise ValueError(
            f"the request needs more KV pages than the pool has ({config.num_pages}); lower max_tokens"
        )
    if config.sliding_pages is not None and window is not None:
        hold = hold_pages(
            prompt_len, prompt_len + max_tokens - 1, request.prefill is not None, config.page_size, window,
            config.prefill_chunk, DECODE_SPAN,
        )
        if hold > config.sliding_pages:
            raise ValueError(
                f"the request needs {hold} pages of the sliding-window KV pool, which has {config.sliding_pages}; "
                "raise sliding_pages or lower prefill_chunk"
            )
    if request.sampling.stop and tokenizer is None:
        raise ValueError("stop strings need text: create the Engine with a tokenizer, or use stop_token_ids")
    if any(not 0 <= t < vocab_size for t in request.prompt_ids):
        raise ValueError(f"prompt_ids must be in [0, {vocab_size})")
