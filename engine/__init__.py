"""foveal.engine: requests, scheduler, the two-slot pipeline, KV cache, sampler and model runners.

engine = Engine(runner, tokenizer, EngineConfig(pipelined=True))
handle = engine.submit(Request(prompt_ids, SamplingParams(max_tokens=64), matcher))
for delta in handle: ...          # text of committed tokens, streamed after each step's finalize
handle.result()                   # RequestOutput(token_ids, text, finish_reason, ..., timings)
"""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.engine")

from .async_engine import AsyncEngine  # noqa: E402
from .config import EngineConfig  # noqa: E402
from .device import Device  # noqa: E402
from .engine import Engine  # noqa: E402
from .matcher import ForcedTokens, Matcher, OwnMask, fill_masks_each  # noqa: E402
from .regions import RegionHeads, RegionSteps  # noqa: E402
from .request import (  # noqa: E402
    FinishReason,
    PrefillInputs,
    Request,
    RequestHandle,
    RequestOutput,
    SamplingParams,
    Timings,
    TokenLogprob,
)
from .runner import ForwardBatch, ModelRunner, Quiesce  # noqa: E402

__all__ = [
    "AsyncEngine",
    "Device",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "ForcedTokens",
    "ForwardBatch",
    "Matcher",
    "ModelRunner",
    "OwnMask",
    "PrefillInputs",
    "Quiesce",
    "RegionHeads",
    "RegionSteps",
    "Request",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "Timings",
    "TokenLogprob",
    "fill_masks_each",
]
