"""`EngineConfig`: what an `Engine` is built with (its sizes, its pipeline's switches, its debug hooks).

Its own module so that `limits.resolve`, which fills the sizes left None from the runner, and the
`Engine`, which is built from the resolved config, both import it and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .kv_cache import DEFAULT_PAGE_SIZE
from .matcher import FillMasks, fill_masks_each


@dataclass(slots=True)
class EngineConfig:
    """Sizes left None are derived from the runner (limits.resolve)."""

    pipelined: bool = True
    max_batch: int = 64  # rows per step
    max_model_len: int | None = None  # prompt + output tokens of one sequence; None: the model's, <= 4096
    max_step_tokens: int | None = None  # query tokens per step; None: max(max_model_len, max_batch, 2048)
    # a text prompt is prefilled this many tokens a launch at most (scheduler.py); None: 512
    prefill_chunk: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None  # KV pages; None: as many as kv_cache_bytes holds, <= max_batch sequences
    kv_cache_bytes: int | None = None  # None: a quarter of free device memory (RAM on CPU)
    # pages of the sliding-window layers' own pool (runner.SlidingWindow, sliding.py), where each
    # sequence holds only its window; None: enough for every lane, or num_pages if that is less
    sliding_pages: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # draws the seeds of requests that give none
    fill_masks: FillMasks = fill_masks_each  # pass foveal.grammars.fill_masks for one native call
    debug: bool = False  # poison host buffers after reading them; check slot states
    debug_hook: Callable[[str], None] | None = None  # called at each phase (tests inject delays)
    trace: bool = False
    switch_interval: float | None = 1e-4  # GIL hand-off interval while the engine runs
    prefix_cache: bool = True  # share the K/V of full prompt pages across requests (kv_cache.py)
    jump_forward: bool = True  # tokens a grammar forces go into the KV cache in one launch (pipeline.py)
    # speculative decoding (pipeline.py): None (off) or "ngram", prompt-lookup drafts verified in
    # one forward; needs a runner with runner.SharedPages (refused by the constructor otherwise)
    speculative: str | None = None
    # decode bursts (bursts.py): a step of rows with no grammar, logprobs or drafts runs up to this
    # many decode sub-steps while no request waits; 1: off; None: 8 on CPU, 1 elsewhere (limits.py)
    decode_burst: int | None = None
    # An idle engine waits this long after the latest arrival (at most 4x in all) before its first
    # launch, so that calls arriving together (threads, a batch) are prefilled in one launch.
    # None: 10 ms on CPU, 2 ms on an accelerator (limits.resolve says why).
    admission_window_s: float | None = None
