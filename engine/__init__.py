"""foveal.engine: requests, scheduler, the two-slot pipeline, KV cache, sampler and model runners.

engine = Engine(runner, tokenizer, EngineConfig(pipelined=True))
handle = engine.submit(Request(prompt_ids, SamplingParams(max_tokens=64), matcher))
for delta in handle: ...          # text of committed tokens, streamed after each step's finalize
handle.result()                   # RequestOutput(token_ids, text, finish_reason, ...)
"""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.engine")

from .async_engine import AsyncEngine  # noqa: E402
from .engine import Engine, EngineConfig  # noqa: E402
from .matcher import Matcher, fill_masks_each  # noqa: E402
from .request import (  # noqa: E402
    FinishReason,
    PrefillInputs,
    Request,
    RequestHandle,
    RequestOutput,
    SamplingParams,
)
from .runner import ForwardBatch, ModelRunner  # noqa: E402

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "ForwardBatch",
    "Matcher",
    "ModelRunner",
    "PrefillInputs",
    "Request",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "fill_masks_each",
]
