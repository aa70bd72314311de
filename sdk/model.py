"""`foveal.load()` and the `Model` facade: caption / query / detect / point / generate / chat on foveal's
pipelined engine, with results as plain dicts (coordinates normalized to [0, 1], origin top-left).

PROBLEM
    A user calls `model.detect(image, "car")` from a script, from 8 threads, over a list of 10,000
    images, or from an asyncio server. Every call must check its input before any work, become one
    engine request (prompt ids, image tensors, a grammar matcher, sampling), batch with the other
    calls in flight, and come back as a plain result dict; a bad call must never disturb the engine
    or the other calls.
SOLUTION
    One `Engine` per `Model`. Every skill, sync or async, streamed or not, on one image or a list,
    takes one path (the public methods are one line each):
      1. call (calls.py): arguments and settings are checked, the family's declared capabilities
         are asked, and the family turns the call into a `Task` (prompt, output spec, parser);
      2. prepare: `Family.prepare` makes the call whole (families/prepared.py): it compiles the
         output spec (SchemaError here; a spatial spec first gets as many items as the token budget
         holds), asks for the images, which this module decodes within the pixel budget and keys
         (ImageError here), renders and encodes the prompt, and returns a `Prepared`: the engine
         `Request` and `read`, which parses and scores the answer;
      3. submit and collect: the engine checks the request against its limits (ValueError here),
         batches every request in flight (from any thread) and detokenizes the answer; the caller
         blocks on its handle (or iterates its text deltas, or awaits it), then `read` gives the
         value and the skill's result type wraps it. A grounded query is two such calls, the
         reasoning's ids in the second's prompt.
    Steps 1-2 run on the caller's thread (a worker thread for async calls) with no lock held: a slow
    compile or a large image never delays another caller's call (compiled specs are cached by
    foveal.grammars, which is safe from many threads; the tokenizer is only read).
    Lists of images go through the same steps with a bounded window of requests in flight.
INVARIANTS (tests/sdk/test_model.py, test_concurrency.py)
    1. Every bad input raises before a request is submitted; the engine then serves the next call.
    2. A constrained answer is parsed only when its grammar completed; a cut answer raises
       IncompleteOutputError instead of returning a partial value.
    3. Concurrent calls with the same seeds return what sequential calls return.
    4. Batch results come back in input order; a failed image yields its exception in its place.
    5. Each request with an image carries `prefill.image_key` (foveal.vision.image_key of the
       decoded image, or of the call's images together), so a runner can reuse that encoding.
    6. Nothing here names a model family, a spec type or a scorer (tests/sdk/test_architecture.py):
       the family is asked.
    7. Each async skill takes its sync twin's arguments (tests/sdk/test_calls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from foveal import calls, families
from foveal import tools as chat_tools
from foveal.engine import AsyncEngine, Engine, EngineConfig, FinishReason, SamplingParams, shutdown
from foveal.engine import models as engine_models
from foveal.engine.request import RequestHandle, RequestOutput
from foveal.errors import GenerationError, IncompleteOutputError, ModelClosedError
from foveal.families import Family
from foveal.families.base import IMAGE_SKILLS
from foveal.families.prepared import CallLimits, Prepared
from foveal.results import (
    AsyncSegmentStream,
    AsyncTextStream,
    CaptionResult,
    ChatResult,
    DetectResult,
    GazeResult,
    GenerateResult,
    PointResult,
    QueryResult,
    Result,
    SegmentResult,
    SegmentStream,
    TextStream,
    Usage,
)
from foveal.skills import RESULTS, guarded, read_value
from foveal.vision import PixelBudget, image_key, load_image
from foveal.vision.budget import DEFAULT_PIXEL_BUDGET

EMBEDDED = Path(__file__).parent / "embedded"


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image decoded and keyed once (`model.encode_image`); pass it to skills instead of the image.

    The key is derived here from a private copy of the pixels, never given: a key that does not
    belong to its image would return another image's cached encoding.
    """

    image: Image.Image
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "image", load_image(self.image))  # a copy: later edits cannot stale the key
        object.__setattr__(self, "key", image_key(self.image))


# ---- loading ------------------------------------------------------------------------------------------------


def load(
    path: str | Path | None = None,
    *,
    device: str = "auto",
    dtype: Any = None,
    pipelined: bool = True,
    max_batch_size: int = 32,
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    image_cache_bytes: int = engine_models.DEFAULT_IMAGE_CACHE_BYTES,
    prefix_cache: bool = True,
    max_step_tokens: int | None = None,
    jump_forward: bool = True,
    speculative: str | None = None,
    decode_burst: int | None = None,
    image_options: dict | None = None,
    quantize: str | None = None,
    pixel_budget: int = DEFAULT_PIXEL_BUDGET,
    revision: str | None = None,
    runner: str = "auto",
) -> Model:
    """Load a model and start its engine.

    `path`: None for the embedded shapes model, a local Hugging Face folder (safetensors), a hub id
    already in the local cache, or a `.gguf` file. `device`: "auto" (CUDA when available), "cpu",
    "cuda". `dtype`: None (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16", "float16".
    `pipelined=False` runs the blocking baseline. `max_batch_size`: sequences decoded together.
    `max_model_len`: prompt + answer tokens per call (default: the model's limit, at most 4096).
    `kv_cache_bytes`: memory for the KV cache (default: a quarter of free device memory, capped
    at what `max_batch_size` sequences of `max_model_len` need).
    `image_cache_bytes`: bound of the cache of image encodings, so that several calls on one image
    encode it once (0 turns the cache off).
    `prefix_cache`: share the K/V of prompt pages that several calls start with (a chat template, a
    system prompt, a document asked many questions, an image asked several questions), so their
    prefill skips them (and the vision encoder, when an image's tokens are all in shared pages).
    `max_step_tokens`: query tokens one engine step may carry (prompts being prefilled + one per
    decoding call; default max(2048, max_model_len)): what bounds how many new calls join a step.
    `jump_forward`: where a call's output grammar forces the next tokens (JSON keys, punctuation),
    write them into the KV cache in one launch instead of one decode step each. The forced tokens
    are the grammar's canonical tokenization of its forced text: where the model would have spelled
    that text with other tokens, the answer's ids, and then possibly what follows, can differ
    (benchmarks/jump_forward.py measures how often).
    `speculative`: None (off) or "ngram": each call's next tokens are guessed from its own prompt
    and output (prompt lookup, cut where the grammar forbids one) and checked in the next launch;
    answers are the ones decoding without it gives (exactly with fp32 weights; a kernel whose
    rounding depends on the launch's rows, a quantized GGUF's int4, can tip a near-tie, as sharing a
    batch can), in fewer steps where answers copy from the prompt; off by default, since fewer steps
    are not always less time (docs/speculative.md has the measurements). Families whose
    runner cannot let one launch's rows share a sequence's pages (runner.SharedPages) refuse it.
    `decode_burst`: while no call waits, a step whose calls have no output grammar, logprobs or drafts
    runs up to this many decode forwards back to back, each sampled on the device side, with one
    step's host work for all of them; the answers are the same, streamed that many tokens at a time,
    and a call arriving meanwhile waits for the burst. None: 8 on CPU, 1 (off) on an accelerator;
    1 turns it off (docs/performance.md).
    `image_options`: the image processor's resolution bounds where the family has them (families
    of dynamic resolution: {"min_pixels": .., "max_pixels": ..}, pixels of the resized image).
    `quantize`: None (the checkpoint's own weights), "int8", "int4" or "fp16" (CPU only): "int8" /
    "int4" are weight-only quantization of the text decoder's linear layers at load (the LM head
    is int8 in both), computed with bf16 activations unless `dtype` says otherwise; "fp16" keeps
    those layers and the head as fp16 for fbgemm's GEMM (x86 builds of torch) with float32
    activations: half the fp32 bytes, the fp32 answers (docs/quantization.md has the figures).
    A llama `.gguf` file on CPU is always read straight from the file: None means, where fbgemm
    exists, its Q4 blocks as int4 for launches of up to 4 rows and fp16 above (docs/quantization.md),
    else its own blocks (Q4_0/Q4_1 as int4, Q8_0 as int8); "int4" keeps its Q4
    blocks as int4 and makes its other layers int4; "int8" makes every layer per-row int8.
    `pixel_budget`: decoded image pixels the model's calls hold at once, all threads together
    (`foveal.vision.PixelBudget`; about 4-8 bytes a pixel): a call beyond it waits, and raises
    `PixelBudgetTimeout` after 10 s. Where the family's processor shrinks every image to a fixed
    size, images are decoded reduced (JPEG DCT scaling, `Image.reduce`) down to a few times that size.
    `revision`: a hub id's branch, tag or commit (None: the default branch), read from the local
    cache. A family that can tell a folder's revision (`Family.checks_revision`) also checks it on
    a local folder and refuses a revision it does not implement; the others refuse it on a local folder.
    `runner`: "auto", "torch" or "ggml". "ggml" runs a `.gguf` file's forward on llama.cpp's own
    kernels (the `gguf` extra: llama-cpp-python), with the engine above it unchanged; "auto" picks
    it for a .gguf file on CPU when the extra is installed and neither `quantize` nor `dtype` is
    given, else torch. `model.runner` says which runs and on which kernels.
    """
    _check_load_args(pipelined, max_batch_size, max_model_len, kv_cache_bytes, max_step_tokens)
    for name, flag in (("prefix_cache", prefix_cache), ("jump_forward", jump_forward)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if speculative not in (None, "ngram"):
        raise ValueError(f"speculative must be None (off) or 'ngram' (prompt-lookup drafts), got {speculative!r}")
    if decode_burst is not None and (isinstance(decode_burst, bool) or not isinstance(decode_burst, int) or decode_burst < 1):
        raise ValueError(f"decode_burst must be None (the device's default) or an int >= 1 (1: off), got {decode_burst!r}")
    family = families.load(
        _model_source(path),
        device=device,
        dtype=dtype,
        image_cache_bytes=image_cache_bytes,
        image_options=image_options,
        quantize=quantize,
        revision=revision,
        runner=runner,
    )
    pixels = PixelBudget(pixel_budget)  # checks the value before the engine starts
    config = engine_config(
        family, pipelined, max_batch_size, max_model_len, kv_cache_bytes, prefix_cache, max_step_tokens, jump_forward,
        speculative, decode_burst,
    )
    return Model(family, config, pixels)


def _check_load_args(
    pipelined: Any, max_batch_size: Any, max_model_len: Any, kv_cache_bytes: Any, max_step_tokens: Any = None
) -> None:
    if not isinstance(pipelined, bool):
        raise TypeError(f"pipelined must be True or False, got {pipelined!r}")
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("max_model_len", max_model_len),
        ("kv_cache_bytes", kv_cache_bytes),
        ("max_step_tokens", max_step_tokens),
    ):
        if value is None and name != "max_batch_size":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _model_source(path: str | Path | None) -> str:
    if path is not None:
        return str(path)
    if not (EMBEDDED / "model.safetensors").is_file():
        raise engine_models.ModelLoadError(
            f"the embedded model's weights are missing ({EMBEDDED} has no model.safetensors): reinstall "
            "foveal, or train and export them with `python -m foveal.training.train_shapes --run runs/shapes "
            f"--export {EMBEDDED}`, or load a checkpoint folder: foveal.load('/path/to/hf_folder')"
        )
    return str(EMBEDDED)


def engine_config(
    family: Family,
    pipelined: bool,
    max_batch_size: int,
    max_model_len: int | None,
    kv_cache_bytes: int | None,
    prefix_cache: bool = True,
    max_step_tokens: int | None = None,
    jump_forward: bool = True,
    speculative: str | None = None,
    decode_burst: int | None = None,
) -> EngineConfig:
    """The engine configuration of a family's model; sizes left None are derived from its runner by the
    engine (foveal.engine.limits: the model's positions, at most 4096 tokens; a quarter of free memory)."""
    return EngineConfig(
        pipelined=pipelined,
        max_batch=max_batch_size,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        prefix_cache=prefix_cache,
        max_step_tokens=max_step_tokens,
        jump_forward=jump_forward,
        speculative=speculative,
        decode_burst=decode_burst,
        eos_token_ids=tuple(family.eos_token_ids),
        fill_masks=family.fill_masks,  # the family's mask policy
    )


# ---- the facade ---------------------------------------------------------------------------------------------


class Model:
    """A loaded model and its engine. Thread-safe: calls from many threads batch together.

    Skills take `image` as a PIL image, a path, bytes, an HxWx3 uint8 array, an `EncodedImage`,
    or (text-only models, and query/generate on vision models that accept it) None. A list of
    images runs the skill on each (see `map`). Results are dicts (foveal.results).
    """

    def __init__(self, family: Family, config: EngineConfig, pixels: PixelBudget | None = None) -> None:
        self.family = family
        self.pixels = pixels or PixelBudget()  # decoded image pixels held at once, all callers
        self.engine = Engine(family.runner, family.tokenizer, config)
        # A model dropped without close() (a notebook cell run again) stops its engine when collected;
        # streams hold the model, so a stream outlives its `foveal.load()` expression.
        shutdown.close_with(self, self.engine)
        self.config = self.engine.config  # sizes resolved from the runner
        assert self.config.max_model_len is not None  # the engine resolves every size it was not given
        self._max_model_len: int = self.config.max_model_len
        self._closed = False

    def __repr__(self) -> str:
        return f"Model(family={self.family.name!r}, source={self.family.source!r})"

    @property
    def runner(self) -> str:
        """Which runner computes the forward and on which kernels: "ggml (llama-cpp-python 0.3.36,
        ...)" for a .gguf file on llama.cpp's kernels, "torch (cpu, float32)" and the like otherwise."""
        return self.family.runner_description()

    @property
    def capabilities(self) -> families.Capabilities:
        """What this model's family declares it can do (skills, images per call, conversations)."""
        return self.family.capabilities

    def close(self) -> None:
        """Stop the engine; calls still running, and calls made later, raise ModelClosedError."""
        self._closed = True
        self.engine.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- skills ----------------------------------------------------------------------------------------------

    def caption(
        self, image: Any, length: str = "normal", stream: bool = False, settings: Mapping | None = None
    ) -> CaptionResult:
        """Describe the image: `{"caption": str}`, or `{"caption": iterator of text chunks}` with stream=True.

        length: "short", "normal" or "long". settings: temperature, top_p, max_tokens, seed.
        """
        return self._call(calls.caption(self.family, image, length, stream, settings))

    def query(
        self,
        image: Any = None,
        question: str | None = None,
        reasoning: bool = False,
        spatial_refs: Any = None,
        stream: bool = False,
        settings: Mapping | None = None,
    ) -> QueryResult:
        """Answer a question about the image: `{"answer": str}` (or an iterator of chunks with stream=True).

        The arguments follow the reference client API's order. `reasoning=True` (models with
        `capabilities.reasoning`): `{"reasoning": {"text", "grounding": [{"start_idx", "end_idx", "points"}]},
        "answer"}`, the reasoning made first, then the answer (streamed with stream=True).
        `spatial_refs`: points [x, y] and boxes [x1, y1, x2, y2] (normalized) the question refers to,
        on models that take them (`capabilities.spatial_refs`).
        """
        return self._call(calls.query(self.family, image, question, reasoning, spatial_refs, stream, settings))

    def detect_gaze(
        self, image: Any, eye: Any = None, face: Any = None, unstable_settings: Mapping | None = None
    ) -> GazeResult:
        """Where the person whose eye is at `eye` (x, y, normalized) looks: `{"gaze": {"x", "y"}}`,
        or `{"gaze": None}` (models with `capabilities.gaze`; the reference client API's signature)."""
        return self._call(calls.detect_gaze(self.family, image, eye, face, unstable_settings))

    def detect(self, image: Any, object: str, settings: Mapping | None = None) -> DetectResult:
        """Boxes of every `object`: `{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}`, floats in [0, 1].

        settings: max_objects (at most that many boxes), temperature, top_p, max_tokens, seed.
        """
        return self._call(calls.detect(self.family, image, object, settings))

    def point(
        self, image: Any, object: str, settings: Mapping | None = None, spatial_refs: Any = None
    ) -> PointResult:
        """Points on every `object`: `{"points": [{"x", "y"}]}`, floats in [0, 1], origin top-left.

        `spatial_refs` (the reference client API's argument): taken only by models that declare it for point
        (`capabilities.spatial_refs`), refused elsewhere."""
        return self._call(calls.point(self.family, image, object, settings, spatial_refs))

    def segment(
        self,
        image: Any,
        object: str,
        spatial_refs: Any = None,
        stream: bool = False,
        settings: Mapping | None = None,
    ) -> SegmentResult | SegmentStream:
        """The outline of `object`: `{"path": SVG path data, "bbox": {"x_min", "y_min", "x_max", "y_max"}}`,
        normalized (models with "segment" in `capabilities.skills`; UnsupportedSkill elsewhere).

        The reference client API's arguments and order. `spatial_refs`: points and boxes that say which
        object is meant, where the model takes them for segment. stream=True: a SegmentStream of
        updates, `{"bbox"}` first, then `{"chunk"}` pieces of the path, then
        `{"path", "bbox", "completed": True}`, as the reference client API yields them.
        """
        return self._call(calls.segment(self.family, image, object, spatial_refs, stream, settings))

    def generate(
        self, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
    ) -> GenerateResult:
        """Answer `prompt` in the shape of `output_type`: `{"text": str, "output": parsed value}`.

        output_type: None (free text), a pydantic model class (output: an instance), a JSON-schema
        dict (output: a dict), foveal.Regex / foveal.CFG / typing.Literal (output: the str or
        literal), or any other type foveal.grammars accepts (the parsers: foveal/grammars/specs.py).
        """
        return self._call(calls.generate(self.family, image, prompt, output_type, settings))

    def chat(
        self,
        messages: Any,
        output_type: Any = None,
        settings: Mapping | None = None,
        stream: bool = False,
        tools: Any = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        logprobs: int | None = None,
    ) -> ChatResult:
        """Answer a conversation: `{"text": str, "output": parsed value}` (output_type as for `generate`;
        without one, output is the text), or `{"text": iterator of chunks, "output": None}` with stream=True.

        messages: OpenAI-style `[{"role": "system" | "user" | "assistant" | "tool", "content": str | [part]}]`,
        a part `{"type": "text", "text": ...}` or `{"type": "image", "image": PIL | path | bytes | array}`;
        images in any user message (as many as `model.capabilities.max_images`). Rendered by the model's
        own chat template; a model without one takes a single user message (capabilities.conversations).
        An assistant message may carry OpenAI's `tool_calls`, a tool message the `tool_call_id` it answers.

        tools: OpenAI function definitions (`{"type": "function", "function": {"name", "description",
        "parameters"}}`); tool_choice: "none", "auto" (the default with tools), "required" or
        `{"type": "function", "function": {"name": ..}}`; every call is valid against its tool's schema
        by construction (foveal.tools), and comes back in `result["tool_calls"]` as
        `[{"id", "name", "arguments": dict}]`. parallel_tool_calls=False: at most one call.
        A template with a thinking section puts the thinking in `result["reasoning"]` (the output type
        and tools constrain only what follows it). logprobs=k (0..20): `result["logprobs"]`, each token's
        log-probability under the grammar's mask and its k most likely alternatives. With stream=True the
        chunks are the raw reply (thinking and call markup included: `foveal.tools.ReplyReader` reads them).
        """
        call = calls.chat(
            self.family, messages, output_type, settings, stream, tools, tool_choice, parallel_tool_calls, logprobs
        )
        return self._call(call)

    def map(
        self, skill: str, images: Iterable[Any], *args: Any, progress: bool | None = True, **kwargs: Any
    ) -> list:
        """Run `skill` over many images, e.g. `model.map("detect", images, "car")`.

        Requests run batched in the engine (a bounded number in flight), with a tqdm progress bar
        (progress=None: only on a terminal; False: none). Results come back in input order; an
        image that fails (unreadable, too large, ...) gets its exception object in its place and the
        others are unaffected. Bad arguments or settings raise before any image is touched.
        """
        if skill not in calls.MAPPED:
            raise ValueError(f"unknown skill {skill!r}; use one of {', '.join(calls.MAPPED)}")
        if isinstance(images, str | bytes) or not isinstance(images, Iterable):
            raise TypeError("images must be a list (or another iterable) of images")
        call = calls.SKILLS[skill](self.family, list(images), *args, **kwargs)
        return self._each(dataclasses.replace(call, progress=progress))

    def encode_image(self, image: Any) -> EncodedImage:
        """Decode and key an image once, for several calls on it."""
        if isinstance(image, EncodedImage):
            return image
        with self.pixels.load(image, min_size=self.family.image_min_size) as decoded:
            return EncodedImage(decoded)

    # ---- async skills ----------------------------------------------------------------------------------------

    async def acaption(
        self, image: Any, length: str = "normal", stream: bool = False, settings: Mapping | None = None
    ) -> CaptionResult:
        """`caption` for asyncio; with stream=True the caption is an async iterator of text chunks."""
        return await self._acall(calls.caption(self.family, image, length, stream, settings))

    async def aquery(
        self,
        image: Any = None,
        question: str | None = None,
        reasoning: bool = False,
        spatial_refs: Any = None,
        stream: bool = False,
        settings: Mapping | None = None,
    ) -> QueryResult:
        """`query` for asyncio; with stream=True the answer is an async iterator of text chunks."""
        return await self._acall(calls.query(self.family, image, question, reasoning, spatial_refs, stream, settings))

    async def adetect_gaze(
        self, image: Any, eye: Any = None, face: Any = None, unstable_settings: Mapping | None = None
    ) -> GazeResult:
        """`detect_gaze` for asyncio."""
        return await self._acall(calls.detect_gaze(self.family, image, eye, face, unstable_settings))

    async def adetect(self, image: Any, object: str, settings: Mapping | None = None) -> DetectResult:
        """`detect` for asyncio."""
        return await self._acall(calls.detect(self.family, image, object, settings))

    async def apoint(
        self, image: Any, object: str, settings: Mapping | None = None, spatial_refs: Any = None
    ) -> PointResult:
        """`point` for asyncio."""
        return await self._acall(calls.point(self.family, image, object, settings, spatial_refs))

    async def asegment(
        self,
        image: Any,
        object: str,
        spatial_refs: Any = None,
        stream: bool = False,
        settings: Mapping | None = None,
    ) -> SegmentResult | AsyncSegmentStream:
        """`segment` for asyncio; with stream=True an async iterator of its updates."""
        return await self._acall(calls.segment(self.family, image, object, spatial_refs, stream, settings))

    async def agenerate(
        self, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
    ) -> GenerateResult:
        """`generate` for asyncio."""
        return await self._acall(calls.generate(self.family, image, prompt, output_type, settings))

    async def achat(
        self,
        messages: Any,
        output_type: Any = None,
        settings: Mapping | None = None,
        stream: bool = False,
        tools: Any = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        logprobs: int | None = None,
    ) -> ChatResult:
        """`chat` for asyncio; with stream=True the text is an async iterator of chunks."""
        call = calls.chat(
            self.family, messages, output_type, settings, stream, tools, tool_choice, parallel_tool_calls, logprobs
        )
        return await self._acall(call)

    # ---- the call path: one for every skill, sync, async, streamed and over lists of images ----------------

    def _call(self, call: calls.Call) -> Any:
        """A call on this thread: prepared here, submitted, then its result (blocking) or its stream."""
        if call.each:
            return self._each(call)
        while True:
            prepared = self._prepare(call)
            handle = self._submit(prepared)
            if call.stream and not call.reasoning:
                chunks = _SyncChunks(self._stream(prepared, handle, call.spent), handle)
                return self._streamed(call, prepared, handle, chunks)
            answer = self._answer(call, prepared, handle.result())
            if not isinstance(answer, calls.Call):
                return answer
            call = answer

    async def _acall(self, call: calls.Call) -> Any:
        """`_call` for asyncio: prepared on a worker thread (a compile or a large image never stalls
        the loop), the answer awaited. A stream is submitted before it is returned, as `_call`'s: a
        request that cannot fit raises here."""
        if call.each:
            each = [self._acall(dataclasses.replace(call, images=[one], each=False)) for one in call.images]
            return list(await asyncio.gather(*each, return_exceptions=True))
        while True:
            prepared = await asyncio.to_thread(self._prepare, call)
            handle = self._submit(prepared)
            if call.stream and not call.reasoning:
                chunks = _AsyncChunks(self._astream(prepared, handle, call.spent), handle)
                return self._streamed(call, prepared, handle, chunks)
            answer = self._answer(call, prepared, await AsyncEngine.finished(handle))
            if not isinstance(answer, calls.Call):
                return answer
            call = answer

    def _answer(self, call: calls.Call, prepared: Prepared, output: RequestOutput) -> Any:
        """A finished request's result; for a grounded query's reasoning phase, the answer's call
        (its prompt holds the reasoning's ids, its coordinates as values, after the reasoning's prompt)."""
        if call.reasoning:
            self._check(prepared, output)
            reasoning, answer_task = self.family.reasoned_answer(prepared.task, output.token_ids)
            return call.answering(answer_task, reasoning, _usage(output))
        if call.plan is not None:
            return self._chat_result(call, prepared, output)
        result = self._result(prepared, output, call.spent)
        return _with_reasoning(result, call.reasoned)

    def _streamed(self, call: calls.Call, prepared: Prepared, handle: RequestHandle, chunks: Any) -> Any:
        """The result of a streamed call: its text an iterator of chunks (async where `chunks` is),
        a chat's read back as it comes (`foveal.tools`)."""
        asynchronous = isinstance(chunks, _AsyncChunks)
        if call.plan is not None:
            so_far = chat_tools.LogprobsSoFar(handle.logprobs, self.family.tokenizer)
            reader = chat_tools.AsyncChatStream if asynchronous else chat_tools.ChatTextStream
            return ChatResult.of_answer("", reader(chunks, call.plan, so_far), prepared.image)
        text = AsyncTextStream(chunks) if asynchronous else TextStream(chunks)
        task = prepared.task
        if task.progress is not None:  # a stream of the value's updates (segment), read by its result type
            parse = guarded(prepared.skill, task.parse or str)
            return RESULTS[prepared.skill].of_updates(text, task.progress, parse, prepared.image)
        return _with_reasoning(RESULTS[prepared.skill].of_answer("", text, prepared.image), call.reasoned)

    def _chat_result(self, call: calls.Call, prepared: Prepared, output: RequestOutput) -> ChatResult:
        """The chat result: the reply read back (thinking, text, tool calls) and the logprobs asked for."""
        plan = call.plan
        assert plan is not None  # a chat call always has its plan
        try:
            result = self._result(prepared, output)
            assert isinstance(result, ChatResult)  # a chat task's result type
        except IncompleteOutputError as cut:  # what was written before the cut, read back
            cut.reply = chat_tools.read_reply(plan, cut.text)
            raise
        if plan.calls_tools or plan.reasoning is not None:
            reply = chat_tools.read_reply(plan, output.text)
            result["text"] = reply.text
            if plan.parse_output is not None:
                result["output"] = guarded(prepared.skill, plan.parse_output)(reply.text)
            elif plan.output_is_text:
                result["output"] = reply.text
            if plan.reasoning is not None:
                result["reasoning"] = reply.reasoning
            if plan.calls_tools:
                result["tool_calls"] = reply.tool_calls
        elif plan.tools:
            result["tool_calls"] = []
        if call.logprobs is not None:
            result["logprobs"] = chat_tools.token_logprobs(output.logprobs or [], self.family.tokenizer)
        return result

    # ---- prepare: the images decoded within the pixel budget, the family makes the call whole --------------

    def _prepare(self, call: calls.Call) -> Prepared:
        """The call ready to submit (`Family.prepare`): the images are decoded only when the family asks
        for them, after its output spec compiled, and their pixels count against the budget until encoded."""
        task, settings = call.task, call.settings
        if self._closed:
            raise ModelClosedError(task.skill)
        sampling = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=settings.max_tokens,
            seed=settings.seed,
            stop=settings.stop,
            logprobs=call.logprobs,
        )
        limits = CallLimits(sampling, call.explicit, self._max_model_len, settings.min_score)
        with contextlib.ExitStack() as held:
            return self.family.prepare(task, lambda: self._images(call.images, task.skill, held), limits)

    def _images(
        self, images: list, skill: str, held: contextlib.ExitStack
    ) -> tuple[list[Image.Image], str | None]:
        """The call's images decoded within the pixel budget (their grants held by `held`), and their
        content key (one image's key, or a key of all of them)."""
        caps, name = self.family.capabilities, self.family.name
        if not images:
            if skill in IMAGE_SKILLS:
                raise ValueError(f"{skill} needs an image; pass image=...")
            if caps.image_required:
                raise ValueError(f"{skill} on this {name} model needs an image; pass image=...")
            return [], None
        if not caps.vision:
            raise ValueError(f"this {name} model is text-only; pass image=None")
        if len(images) > caps.max_images:
            raise ValueError(
                f"this {name} model takes at most {caps.max_images} image(s) per call; {len(images)} were given"
            )
        decoded, keys = [], []
        for image in images:
            if isinstance(image, EncodedImage):
                decoded.append(image.image)
                keys.append(image.key)
                continue
            picture = held.enter_context(self.pixels.load(image, min_size=self.family.image_min_size))
            decoded.append(picture)
            keys.append(image_key(picture))
        if len(keys) == 1:
            return decoded, keys[0]
        return decoded, hashlib.sha256("|".join(keys).encode()).hexdigest()

    # ---- submit and collect -----------------------------------------------------------------------------------

    def _submit(self, prepared: Prepared) -> RequestHandle:
        try:
            return self.engine.submit(prepared.request)
        except RuntimeError:
            if self._closed:  # closed by another thread since _prepare looked
                raise ModelClosedError(prepared.skill) from None
            raise

    def _stream(
        self, prepared: Prepared, handle: RequestHandle, before: Usage | None = None
    ) -> Generator[str, None, Usage]:
        try:
            yield from handle
            output = handle.result()
            self._check(prepared, output)
            return _usage(output, before)
        finally:
            handle.cancel()  # the caller stopped early: free the sequence (no-op when finished)

    async def _astream(
        self, prepared: Prepared, handle: RequestHandle, before: Usage | None = None
    ) -> AsyncIterator[str | Usage]:
        """The async twin of `_stream`: an engine error, a cancellation or a cut constrained answer
        raises at the end of the stream, as it does for the sync stream and the whole result."""
        try:
            async for delta in AsyncEngine.deltas(handle):
                yield delta
            output = handle.result()
            self._check(prepared, output)
            yield _usage(output, before)  # AsyncTextStream keeps it as its .usage
        finally:
            handle.cancel()  # the caller stopped early: free the sequence (no-op when finished)

    def _result(self, prepared: Prepared, output: RequestOutput, before: Usage | None = None) -> Result:
        """The skill's result: the value `prepared.read` gives (a constrained answer that does not read
        is a GenerationError naming the skill), the answer's text and the usage (with `before`'s, the
        usage of a request this call made first)."""
        self._check(prepared, output)
        value = read_value(prepared.skill, prepared.read, output)
        result = RESULTS[prepared.skill].of_answer(output.text, value, prepared.image)
        result.usage = _usage(output, before)
        return result

    def _check(self, prepared: Prepared, output: RequestOutput) -> None:
        skill = prepared.skill
        if output.finish_reason is FinishReason.ERROR:
            raise GenerationError(f"{skill} failed in the engine: {output.error}")
        if output.finish_reason is FinishReason.CANCELLED and self._closed:
            raise ModelClosedError(skill)
        if output.finish_reason is FinishReason.CANCELLED:
            raise GenerationError(f"{skill} was cancelled (the call or its stream was stopped)")
        if output.finish_reason is FinishReason.LENGTH and prepared.constrained:
            max_tokens = prepared.request.sampling.max_tokens
            context_limited = len(prepared.request.prompt_ids) + max_tokens >= self._max_model_len
            raise IncompleteOutputError(skill, max_tokens, output.text, context_limited, _usage(output))

    def _each(self, call: calls.Call) -> list:
        """The call's task on each of its images, a bounded window in flight, results in input order
        (an image that fails gets its exception in its place)."""
        results: list[Any] = [None] * len(call.images)
        window: deque[tuple[int, Prepared, RequestHandle]] = deque()
        bar = tqdm(
            total=len(call.images),
            desc=call.task.skill,
            unit="image",
            disable=None if call.progress is None else not call.progress,
        )

        def collect_oldest() -> None:
            index, prepared, handle = window.popleft()
            try:
                results[index] = self._result(prepared, handle.result())
            except Exception as error:  # reported in its place; the other images go on
                results[index] = error
            bar.update()

        try:
            for index, image in enumerate(call.images):
                try:
                    prepared = self._prepare(dataclasses.replace(call, images=[image], each=False))
                    window.append((index, prepared, self._submit(prepared)))
                except Exception as error:
                    results[index] = error
                    bar.update()
                while len(window) >= 2 * self.config.max_batch:
                    collect_oldest()
            while window:
                collect_oldest()
        finally:
            for _, _, handle in window:  # interrupted (e.g. KeyboardInterrupt): stop what is left
                handle.cancel()
            bar.close()
        return results

class _SyncChunks(Generator[str, None, Usage]):
    """`_stream`'s generator over a submitted request, whose `close` cancels the request even when the
    generator never started (closing a generator before its first step skips its `finally`): a
    stream closed before its first read frees its place in the engine."""

    __slots__ = ("_chunks", "_handle")

    def __init__(self, chunks: Generator[str, None, Usage], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    def send(self, value: None) -> str:
        return self._chunks.send(value)

    def throw(self, *args: Any) -> str:
        return self._chunks.throw(*args)

    def close(self) -> None:
        try:
            self._chunks.close()
        finally:
            self._handle.cancel()  # a no-op once finished


class _AsyncChunks:
    """`_astream`'s generator over a submitted request, whose `aclose` cancels the request even when
    the generator never started (closing an async generator before its first step skips its
    `finally`): a stream closed before its first read frees its place in the engine."""

    __slots__ = ("_chunks", "_handle")

    def __init__(self, chunks: AsyncIterator[str | Usage], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    def __aiter__(self) -> _AsyncChunks:
        return self

    async def __anext__(self) -> str | Usage:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            self._handle.cancel()  # a no-op once finished


def _with_reasoning(result: Result, reasoning: dict | None) -> Result:
    """A grounded query's answer with the reasoning it was given (only a query is grounded)."""
    if reasoning is None:
        return result
    assert isinstance(result, QueryResult)
    return result.with_reasoning(reasoning)


def _usage(output: RequestOutput, before: Usage | None = None) -> Usage:
    """What a request cost (its engine Timings in milliseconds), after `before` where the call made
    another request first (a grounded query's reasoning)."""
    t = output.timings
    times = (0.0, 0.0, 0.0) if t is None else (t.prefill_s * 1e3, t.decode_s * 1e3, t.ttft_s * 1e3)
    usage = Usage(output.num_prompt_tokens, len(output.token_ids), output.finish_reason.value, *times)
    return usage if before is None else before.then(usage)
