"""`foveal.load()` and the `Model` facade: caption / query / detect / point / generate / chat on foveal's
pipelined engine, with results as plain dicts (coordinates normalized to [0, 1], origin top-left).

PROBLEM
    A user calls `model.detect(image, "car")` from a script, from 8 threads, over a list of 10,000
    images, or from an asyncio server. Every call must check its input before any work, become one
    engine request (prompt ids, image tensors, a grammar matcher, sampling), batch with the other
    calls in flight, and come back as a plain result dict; a bad call must never disturb the engine
    or the other calls.
SOLUTION
    One `Engine` per `Model`. A call goes through three steps:
      1. task: arguments and settings are checked (skills.py), the family's declared capabilities
         are asked, and the family turns the call into a `Task` (prompt, output spec, parser);
      2. prepare: the family compiles the output spec into an automaton that carries the parser
         of its text (SchemaError here; a spatial spec first gets as many items as the token
         budget holds), the images are decoded and keyed (ImageError here), the family renders
         the prompt (its chat template) and its processor builds prompt ids and `PrefillInputs`
         (image tensors, key, prefix): a `Job` holding a `Request`;
      3. submit and collect: the engine checks the request against its limits (ValueError here),
         batches every request in flight (from any thread) and detokenizes the answer (special
         tokens kept where the format answers in them); the caller blocks on its handle (or
         iterates its text deltas, or awaits it), then the parser turns the text into the value
         and the task's result type wraps it.
    Steps 1-2 run on the caller's thread with no lock held: a slow compile or a large image never
    delays another caller's call (compiled specs are cached by foveal.grammars, which is safe from
    many threads; the tokenizer is only read). The model has one tokenizer, shared with the
    engine's detokenizer.
    Lists of images go through the same steps with a bounded window of requests in flight.
INVARIANTS (tests/sdk/test_model.py, test_concurrency.py)
    1. Every bad input raises before a request is submitted; the engine then serves the next call.
    2. A constrained answer is parsed only when its grammar completed; a cut answer raises
       IncompleteOutputError instead of returning a partial value.
    3. Concurrent calls with the same seeds return what sequential calls return.
    4. Batch results come back in input order; a failed image yields its exception in its place.
    5. Each request with an image carries `prefill.image_key` (foveal.vision.image_key of the
       decoded image, or of the call's images together), so a runner can reuse that encoding.
    6. Nothing here names a model family (tests/sdk/test_architecture.py): the family is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from foveal import families
from foveal import tools as chat_tools
from foveal.engine import AsyncEngine, Engine, EngineConfig, FinishReason, Request, SamplingParams, shutdown
from foveal.engine import models as engine_models
from foveal.engine.request import RequestHandle, RequestOutput
from foveal.errors import GenerationError, IncompleteOutputError, ModelClosedError
from foveal.families import Family
from foveal.families.base import IMAGE_SKILLS
from foveal.families.task import SCORE_ALTERNATIVES, Decoded, Task, with_scores
from foveal.grammars import spatial
from foveal.results import (
    AsyncTextStream,
    CaptionResult,
    ChatResult,
    DetectResult,
    GazeResult,
    GenerateResult,
    PointResult,
    QueryResult,
    Result,
    TextStream,
    Usage,
)
from foveal.settings import Settings, validate_settings
from foveal.skills import (
    RESULTS,
    check_eye,
    check_length,
    check_object,
    check_spatial_refs,
    check_text,
    conversation,
    guarded,
    parser,
)
from foveal.vision import PixelBudget, image_key, load_image
from foveal.vision.budget import DEFAULT_PIXEL_BUDGET

EMBEDDED = Path(__file__).parent / "embedded"
SKILLS = ("caption", "query", "detect", "point", "generate")  # the skills `map` runs over images
SETTINGS_OF = {"chat": "generate", "gaze": "point"}  # whose settings a skill takes (validate_settings)


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


@dataclass(slots=True)
class Job:
    """One prepared call: its task, the engine request, the parser of its answer, the decoded image."""

    task: Task
    request: Request
    parse: Callable[[str], Any]  # the task's parser, or its compiled output spec's
    image: Image.Image | None  # the call's (first) image, which the result is about
    tokenizer: Any = None  # the compiled answer's tokenizer handle (what a scorer reads tokens with)
    min_score: float = 0.0  # scored items below it are left out

    @property
    def result(self) -> type[Result]:
        return RESULTS[self.task.skill]


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
    image_options: dict | None = None,
    quantize: str | None = None,
    pixel_budget: int = DEFAULT_PIXEL_BUDGET,
    revision: str | None = None,
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
    (a small text model, greedy: none of 80 answers did; benchmarks/jump_forward.py).
    `speculative`: None (off) or "ngram": each call's next tokens are guessed from its own prompt
    and output (prompt lookup, cut where the grammar forbids one) and checked in the next launch;
    answers are the ones decoding without it gives (exactly with fp32 weights; a kernel whose
    rounding depends on the launch's rows, a quantized GGUF's int4, can tip a near-tie, as sharing a
    batch can), in fewer steps where answers copy from the prompt (docs/speculative.md has the
    figures: no wall-clock gain measured on this CPU yet, so it is off by default). Families whose
    runner cannot let one launch's rows share a sequence's pages (runner.SharedPages) refuse it.
    `image_options`: the image processor's resolution bounds where the family has them (families
    of dynamic resolution: {"min_pixels": .., "max_pixels": ..}, pixels of the resized image).
    `quantize`: None (the checkpoint's own weights), "int8", "int4" or "fp16" (CPU only): "int8" /
    "int4" are weight-only quantization of the text decoder's linear layers at load (the LM head
    is int8 in both), computed with bf16 activations unless `dtype` says otherwise; "fp16" keeps
    those layers and the head as fp16 for fbgemm's GEMM (x86 builds of torch) with float32
    activations: half the fp32 bytes, the fp32 answers (engine/models/quant.py has the figures).
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
    """
    _check_load_args(pipelined, max_batch_size, max_model_len, kv_cache_bytes, max_step_tokens)
    for name, flag in (("prefix_cache", prefix_cache), ("jump_forward", jump_forward)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if speculative not in (None, "ngram"):
        raise ValueError(f"speculative must be None (off) or 'ngram' (prompt-lookup drafts), got {speculative!r}")
    family = families.load(
        _model_source(path),
        device=device,
        dtype=dtype,
        image_cache_bytes=image_cache_bytes,
        image_options=image_options,
        quantize=quantize,
        revision=revision,
    )
    pixels = PixelBudget(pixel_budget)  # checks the value before the engine starts
    config = engine_config(
        family, pipelined, max_batch_size, max_model_len, kv_cache_bytes, prefix_cache, max_step_tokens, jump_forward,
        speculative,
    )
    return Model(family, config, pixels)


def _check_flag(name: str, value: Any, where: str) -> None:
    """A flag passed positionally where a settings dict was meant is refused, saying where it went."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {value!r}: {name} is {where}; pass settings=... by keyword"
        )


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
        self._closed = False

    def __repr__(self) -> str:
        return f"Model(family={self.family.name!r}, source={self.family.source!r})"

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
        return self._dispatch(*self._caption_task(length, settings), image, stream)

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
        _check_flag("reasoning", reasoning, "query's third argument (the reference's order)")
        _check_flag("stream", stream, "query's fifth argument")
        if reasoning:
            return self._reason(image, question, spatial_refs, stream, settings)
        return self._dispatch(*self._query_task(question, settings, spatial_refs), image, stream)

    def detect_gaze(
        self, image: Any, eye: Any = None, face: Any = None, unstable_settings: Mapping | None = None
    ) -> GazeResult:
        """Where the person whose eye is at `eye` (x, y, normalized) looks: `{"gaze": {"x", "y"}}`,
        or `{"gaze": None}` (models with `capabilities.gaze`; the reference client API's signature)."""
        return self._dispatch(*self._gaze_task(eye, face, unstable_settings), image, False)

    def detect(self, image: Any, object: str, settings: Mapping | None = None) -> DetectResult:
        """Boxes of every `object`: `{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}`, floats in [0, 1].

        settings: max_objects (at most that many boxes), temperature, top_p, max_tokens, seed.
        """
        return self._dispatch(*self._detect_task(object, settings), image, False)

    def point(
        self, image: Any, object: str, settings: Mapping | None = None, spatial_refs: Any = None
    ) -> PointResult:
        """Points on every `object`: `{"points": [{"x", "y"}]}`, floats in [0, 1], origin top-left.

        `spatial_refs` (the reference client API's argument): taken only by models that declare it for point
        (`capabilities.spatial_refs`), refused elsewhere."""
        return self._dispatch(*self._point_task(object, settings, spatial_refs), image, False)

    def generate(
        self, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
    ) -> GenerateResult:
        """Answer `prompt` in the shape of `output_type`: `{"text": str, "output": parsed value}`.

        output_type: None (free text), a pydantic model class (output: an instance), a JSON-schema
        dict (output: a dict), foveal.Regex / foveal.CFG / typing.Literal (output: the str or
        literal), or any other type foveal.grammars accepts (the parsers: foveal/grammars/specs.py).
        """
        return self._dispatch(*self._generate_task(prompt, output_type, settings), image, False)

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
        call = self._chat_task(messages, output_type, settings, stream, tools, tool_choice, parallel_tool_calls)
        task, images, s, explicit, chat_plan = call
        job = self._prepare(task, images, s, explicit)
        self._chat_sampling(job, logprobs)
        handle = self._submit(job)
        if stream:
            logprobs_so_far = chat_tools.LogprobsSoFar(handle.logprobs, self.family.tokenizer)
            text = chat_tools.ChatTextStream(self._stream(job, handle), chat_plan, logprobs_so_far)
            return ChatResult.of_answer("", text, job.image)
        return self._chat_result(job, handle.result(), chat_plan, logprobs)

    def map(
        self, skill: str, images: Iterable[Any], *args: Any, progress: bool | None = True, **kwargs: Any
    ) -> list:
        """Run `skill` over many images, e.g. `model.map("detect", images, "car")`.

        Requests run batched in the engine (a bounded number in flight), with a tqdm progress bar
        (progress=None: only on a terminal; False: none). Results come back in input order; an
        image that fails (unreadable, too large, ...) gets its exception object in its place and the
        others are unaffected. Bad arguments or settings raise before any image is touched.
        """
        if skill not in SKILLS:
            raise ValueError(f"unknown skill {skill!r}; use one of {', '.join(SKILLS)}")
        if isinstance(images, str | bytes) or not isinstance(images, Iterable):
            raise TypeError("images must be a list (or another iterable) of images")
        task, settings, explicit = getattr(self, f"_{skill}_task")(*args, **kwargs)
        return self._batch(task, list(images), settings, explicit, progress)

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
        return await self._adispatch(*self._caption_task(length, settings), image, stream)

    async def aquery(
        self,
        image: Any,
        question: str,
        stream: bool = False,
        settings: Mapping | None = None,
        *,
        reasoning: bool = False,
        spatial_refs: Any = None,
    ) -> QueryResult:
        """`query` for asyncio; with stream=True the answer is an async iterator of text chunks.
        (foveal's own order: stream third; reasoning and spatial_refs by keyword.)"""
        if reasoning:
            return await self._areason(image, question, spatial_refs, stream, settings)
        return await self._adispatch(*self._query_task(question, settings, spatial_refs), image, stream)

    async def adetect_gaze(
        self, image: Any, eye: Any = None, face: Any = None, unstable_settings: Mapping | None = None
    ) -> GazeResult:
        """`detect_gaze` for asyncio."""
        return await self._adispatch(*self._gaze_task(eye, face, unstable_settings), image, False)

    async def adetect(self, image: Any, object: str, settings: Mapping | None = None) -> DetectResult:
        """`detect` for asyncio."""
        return await self._adispatch(*self._detect_task(object, settings), image, False)

    async def apoint(
        self, image: Any, object: str, settings: Mapping | None = None, spatial_refs: Any = None
    ) -> PointResult:
        """`point` for asyncio."""
        return await self._adispatch(*self._point_task(object, settings, spatial_refs), image, False)

    async def agenerate(
        self, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
    ) -> GenerateResult:
        """`generate` for asyncio."""
        return await self._adispatch(*self._generate_task(prompt, output_type, settings), image, False)

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
        call = self._chat_task(messages, output_type, settings, stream, tools, tool_choice, parallel_tool_calls)
        task, images, s, explicit, chat_plan = call
        job = await asyncio.to_thread(self._prepare, task, images, s, explicit)
        self._chat_sampling(job, logprobs)
        if stream:  # submitted before the stream is returned, as chat's: a request that cannot fit raises here
            handle = self._submit(job)
            logprobs_so_far = chat_tools.LogprobsSoFar(handle.logprobs, self.family.tokenizer)
            text = chat_tools.AsyncChatStream(_Chunks(self._astream(job, handle), handle), chat_plan, logprobs_so_far)
            return ChatResult.of_answer("", text, job.image)
        output = await AsyncEngine(self.engine).generate(job.request)
        return self._chat_result(job, output, chat_plan, logprobs)

    # ---- step 1: tasks (arguments, settings, the family's task; no image) ----------------------------------

    def _task(self, skill: str, settings: Mapping | None, make: Callable[[Settings], Task]) -> tuple[Task, Settings, bool]:
        """The family's task for a call (`make(validated settings)`), after the settings and the
        family's declared skills are checked."""
        s, explicit = _settings(settings, SETTINGS_OF.get(skill, skill))
        caps = self.family.capabilities
        if skill not in caps.skills and skill != "gaze":
            raise self.family.unsupported(skill)
        if not explicit and caps.token_budget is not None and skill in ("caption", "query"):
            s = dataclasses.replace(s, max_tokens=caps.token_budget)  # the family's own default
        task = self.family.with_settings(make(s), s)
        if s.stop and task.spec is not None:
            raise ValueError(
                f"settings['stop'] applies to free text; this {skill} answer is decoded under its output "
                "grammar, which decides where it ends: remove stop"
            )
        return task, s, explicit

    def _caption_task(self, length: str = "normal", settings: Mapping | None = None) -> tuple[Task, Settings, bool]:
        check_length(length)
        return self._task("caption", settings, lambda _: self.family.caption(length))

    def _query_task(self, question: str, settings: Mapping | None = None, spatial_refs: Any = None) -> tuple[Task, Settings, bool]:
        text = check_text("question", question).strip()
        refs = check_spatial_refs(spatial_refs)
        if refs is None:
            return self._task("query", settings, lambda _: self.family.query(text))
        return self._task("query", settings, lambda _: self.family.spatial_query(text, refs))

    def _reasoning_task(self, question: str, spatial_refs: Any, settings: Mapping | None) -> tuple[Task, Settings, bool]:
        text = check_text("question", question).strip()
        refs = check_spatial_refs(spatial_refs)
        if not self.family.capabilities.reasoning:
            raise self.family.unsupported("reasoning")
        return self._task("query", settings, lambda _: self.family.reasoning(text, refs))

    def _gaze_task(self, eye: Any, face: Any, unstable_settings: Mapping | None) -> tuple[Task, Settings, bool]:
        if not self.family.capabilities.gaze:
            raise self.family.unsupported("detect_gaze")
        if eye is None:
            raise ValueError("detect_gaze needs eye=(x, y), normalized; locating the face (face=) is not implemented")
        if face is not None or unstable_settings:
            raise ValueError(
                "detect_gaze takes eye=(x, y) only: face= and unstable_settings (prioritize_accuracy, "
                "force_detect) are not implemented; remove them"
            )
        point = check_eye(eye)
        return self._task("gaze", None, lambda _: self.family.detect_gaze(point))

    def _reason(self, image: Any, question: Any, spatial_refs: Any, stream: bool, settings: Any) -> QueryResult:
        """A grounded query: the reasoning request, then the answer request, whose prompt holds the
        reasoning's ids (its coordinates as values) after the reasoning's prompt."""
        if isinstance(image, list | tuple):
            raise ValueError("reasoning=True takes one image, not a list")
        task, s, explicit = self._reasoning_task(question, spatial_refs, settings)
        images = [] if image is None else [image]
        job = self._prepare(task, images, s, explicit)
        output = self._submit(job).result()
        self._check(job, output)
        reasoning, answer_task = self.family.reasoned_answer(job.task, output.token_ids)
        result = self._run(answer_task, images, s, explicit, stream)
        return result.with_reasoning(reasoning)

    async def _areason(
        self, image: Any, question: Any, spatial_refs: Any, stream: bool, settings: Any
    ) -> QueryResult:
        """`_reason` for asyncio."""
        if isinstance(image, list | tuple):
            raise ValueError("reasoning=True takes one image, not a list")
        task, s, explicit = self._reasoning_task(question, spatial_refs, settings)
        images = [] if image is None else [image]
        job = await asyncio.to_thread(self._prepare, task, images, s, explicit)
        output = await AsyncEngine(self.engine).generate(job.request)
        self._check(job, output)
        reasoning, answer_task = self.family.reasoned_answer(job.task, output.token_ids)
        result = await self._arun(answer_task, images, s, explicit, stream)
        return result.with_reasoning(reasoning)

    def _detect_task(self, object: str, settings: Mapping | None = None) -> tuple[Task, Settings, bool]:
        phrase = check_object(object)
        return self._task("detect", settings, lambda s: self.family.detect(phrase, s.max_objects))

    def _point_task(self, object: str, settings: Mapping | None = None, spatial_refs: Any = None) -> tuple[Task, Settings, bool]:
        phrase = check_object(object)
        if check_spatial_refs(spatial_refs) is not None:  # no family points from references yet
            raise self.family.unsupported_option("spatial_refs on point", self.family.refs_hint())
        return self._task("point", settings, lambda s: self.family.point(phrase, s.max_objects))

    def _generate_task(self, prompt: str, output_type: Any = None, settings: Mapping | None = None) -> tuple[Task, Settings, bool]:
        check_text("prompt", prompt)
        return self._task("generate", settings, lambda _: self.family.generate(prompt, output_type))

    def _chat_task(
        self,
        messages: Any,
        output_type: Any,
        settings: Mapping | None,
        stream: bool,
        tools: Any = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
    ) -> tuple:
        """The chat call's task, images, settings and `foveal.tools.ChatPlan` (its grammar: tools, the
        thinking section); raises before any work."""
        plain, fields = chat_tools.split_tool_fields(messages)
        talk, images = conversation(plain)
        chat_plan = chat_tools.plan(
            output_type, tools, tool_choice, parallel_tool_calls, self.family.tool_format, self.family.thinking
        )
        if (chat_plan.tools or any(calls for calls, _ in fields)) and not self.capabilities.conversations:
            raise ValueError(
                f"this {self.family.name} model has no chat template, so it cannot be given tools or tool "
                "messages; use a checkpoint whose tokenizer has a chat_template"
            )
        talk = chat_tools.attach_tool_fields(talk, fields, chat_plan)
        for where, text in chat_tools.plain_texts(chat_plan, talk):
            self.family.plain(where, text)
        task, s, explicit = self._task("chat", settings, lambda _: self.family.chat(talk, chat_plan.spec))
        return task, images, s, explicit, chat_plan

    def _chat_sampling(self, job: Job, logprobs: int | None) -> None:
        """A chat request that records `logprobs` alternatives per token (SamplingParams checks k)."""
        if logprobs is not None:
            job.request.sampling = dataclasses.replace(job.request.sampling, logprobs=logprobs)

    def _chat_result(self, job: Job, output: RequestOutput, chat_plan: Any, logprobs: int | None) -> ChatResult:
        """The chat result: the reply read back (thinking, text, tool calls) and the logprobs asked for."""
        try:
            result = self._result(job, output)
        except IncompleteOutputError as cut:  # what was written before the cut, read back
            cut.reply = chat_tools.read_reply(chat_plan, cut.text)
            raise
        if chat_plan.calls_tools or chat_plan.reasoning is not None:
            reply = chat_tools.read_reply(chat_plan, output.text)
            result["text"] = reply.text
            if chat_plan.parse_output is not None:
                result["output"] = guarded(job.task.skill, chat_plan.parse_output)(reply.text)
            elif isinstance(chat_plan.spec, chat_tools.CFG) or chat_plan.spec is None:
                result["output"] = reply.text
            if chat_plan.reasoning is not None:
                result["reasoning"] = reply.reasoning
            if chat_plan.calls_tools:
                result["tool_calls"] = reply.tool_calls
        elif chat_plan.tools:
            result["tool_calls"] = []
        if logprobs is not None:
            result["logprobs"] = chat_tools.token_logprobs(output.logprobs or [], self.family.tokenizer)
        return result

    # ---- step 2: prepare (grammar, images, prompt ids, token budget) ------------------------------------------

    def _prepare(self, task: Task, images: list, settings: Settings, explicit: bool) -> Job:
        if self._closed:
            raise ModelClosedError(task.skill)
        spatial_answer = isinstance(task.spec, spatial.SpatialSpec)
        # other specs compile first: a bad output type fails before the image is read
        automaton = None if spatial_answer else self.family.compile(task.spec)
        with contextlib.ExitStack() as held:  # the decoded pixels count against the budget until encoded
            decoded, key = self._images(images, task.skill, held)
            prompt, task = self.family.encode(task, decoded, key)
        max_tokens = self._budget(len(prompt.token_ids), settings.max_tokens, explicit)
        if spatial_answer:  # its item count is sized to the budget, then compiled
            task = self._fit_items(task, len(prompt.token_ids), max_tokens)
            automaton = self.family.compile(task.spec)
        if automaton is not None and automaton.min_tokens > max_tokens:
            raise ValueError(
                f"every answer of this output type starts with {automaton.min_tokens} tokens of fixed text, "
                f"more than the {max_tokens} it may have (settings['max_tokens'], at most what the context "
                "leaves after the prompt); raise max_tokens, shorten the fixed text, or put it in the prompt"
            )
        sampling = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=max_tokens,
            seed=settings.seed,
            stop=settings.stop,
            skip_special_tokens=not task.keep_special,  # the text the parser reads, made by the engine
            logprobs=SCORE_ALTERNATIVES if task.score is not None else None,  # what the scores read
        )
        if automaton is not None:
            matcher = automaton.matcher()
        else:  # a family's own automaton, or free text (which masks the family's reserved tokens)
            matcher = task.rules() if task.rules is not None else self.family.free_text_matcher()
        request = Request(prompt.token_ids, sampling, matcher, prompt.prefill)
        image = decoded[0] if decoded else None
        tokens = getattr(automaton, "tokenizer", None)
        return Job(task, request, parser(task, automaton), image, tokens, settings.min_score)

    def _fit_items(self, task: Task, prompt_len: int, max_tokens: int) -> Task:
        """A spatial answer's max_objects lowered to the items `max_tokens` holds whatever spelling the
        grammar lets the model pick, so a complete answer always fits; ValueError when not one item does."""
        fitted, one = self.family.fit_items(task, max_tokens)
        if fitted is not None:
            return fitted
        room = self.config.max_model_len - prompt_len
        if one <= room:
            raise ValueError(
                f"settings['max_tokens']={max_tokens} cannot hold one {task.skill} item (up to {one} tokens with "
                f"this object phrase); use max_tokens >= {one} or a shorter object phrase"
            )
        raise ValueError(
            f"one {task.skill} item takes up to {one} tokens with this object phrase, but this model's context of "
            f"{self.config.max_model_len} leaves {room} after the prompt ({prompt_len} tokens); shorten the phrase"
        )

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

    def _budget(self, prompt_len: int, max_tokens: int, explicit: bool) -> int:
        """max_tokens for this prompt: a skill's default shrinks to the room the prompt leaves; an
        explicit one is the caller's. Whether it fits is checked once, by the engine's submit."""
        if explicit:
            return max_tokens
        return max(1, min(max_tokens, self.config.max_model_len - prompt_len))

    # ---- step 3: submit and collect --------------------------------------------------------------------------

    def _dispatch(self, task: Task, settings: Settings, explicit: bool, image: Any, stream: bool) -> Any:
        """A skill call on one image (or none), or on each image of a list."""
        if isinstance(image, list | tuple):
            if stream:
                raise ValueError("stream=True takes one image, not a list")
            return self._batch(task, list(image), settings, explicit, progress=None)
        return self._run(task, [] if image is None else [image], settings, explicit, stream)

    def _run(self, task: Task, images: list, settings: Settings, explicit: bool, stream: bool) -> Any:
        job = self._prepare(task, images, settings, explicit)
        handle = self._submit(job)
        if stream:
            return job.result.of_answer("", TextStream(self._stream(job, handle)), job.image)
        return self._result(job, handle.result())

    def _stream(self, job: Job, handle: RequestHandle) -> Generator[str, None, Usage]:
        try:
            yield from handle
            output = handle.result()
            self._check(job, output)
            return _usage(output)
        finally:
            handle.cancel()  # the caller stopped early: free the sequence (no-op when finished)

    def _result(self, job: Job, output: RequestOutput) -> Result:
        self._check(job, output)
        value = job.parse(output.text)
        if job.task.score is not None:  # boxes and points, each with its "score"
            eos = frozenset(self.family.eos_token_ids)
            decoded = Decoded(output.token_ids, output.logprobs or [], job.tokenizer, eos)
            value = with_scores(value, job.task.score(decoded), job.min_score)
        result = job.result.of_answer(output.text, value, job.image)
        result.usage = _usage(output)
        return result

    def _submit(self, job: Job) -> RequestHandle:
        try:
            return self.engine.submit(job.request)
        except RuntimeError:
            if self._closed:  # closed by another thread since _prepare looked
                raise ModelClosedError(job.task.skill) from None
            raise

    def _check(self, job: Job, output: RequestOutput) -> None:
        if output.finish_reason is FinishReason.ERROR:
            raise GenerationError(f"{job.task.skill} failed in the engine: {output.error}")
        if output.finish_reason is FinishReason.CANCELLED and self._closed:
            raise ModelClosedError(job.task.skill)
        if output.finish_reason is FinishReason.CANCELLED:
            raise GenerationError(f"{job.task.skill} was cancelled (the call or its stream was stopped)")
        if output.finish_reason is FinishReason.LENGTH and job.task.spec is not None:
            max_tokens = job.request.sampling.max_tokens
            context_limited = len(job.request.prompt_ids) + max_tokens >= self.config.max_model_len
            raise IncompleteOutputError(job.task.skill, max_tokens, output.text, context_limited, _usage(output))

    def _batch(
        self, task: Task, images: list, settings: Settings, explicit: bool, progress: bool | None
    ) -> list:
        results: list[Any] = [None] * len(images)
        window: deque[tuple[int, Job, RequestHandle]] = deque()
        bar = tqdm(
            total=len(images),
            desc=task.skill,
            unit="image",
            disable=None if progress is None else not progress,
        )

        def collect_oldest() -> None:
            index, job, handle = window.popleft()
            try:
                results[index] = self._result(job, handle.result())
            except Exception as error:  # reported in its place; the other images go on
                results[index] = error
            bar.update()

        try:
            for index, image in enumerate(images):
                try:
                    job = self._prepare(task, [image], settings, explicit)
                    window.append((index, job, self._submit(job)))
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

    async def _adispatch(
        self, task: Task, settings: Settings, explicit: bool, image: Any, stream: bool
    ) -> Any:
        if isinstance(image, list | tuple):
            if stream:
                raise ValueError("stream=True takes one image, not a list")
            calls = [self._arun(task, [one], settings, explicit, False) for one in image]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        return await self._arun(task, [] if image is None else [image], settings, explicit, stream)

    async def _arun(self, task: Task, images: list, settings: Settings, explicit: bool, stream: bool) -> Any:
        job = await asyncio.to_thread(self._prepare, task, images, settings, explicit)
        if stream:  # submitted before the stream is returned, as _run's: a request that cannot fit raises here
            handle = self._submit(job)
            return job.result.of_answer("", AsyncTextStream(_Chunks(self._astream(job, handle), handle)), job.image)
        return self._result(job, await AsyncEngine(self.engine).generate(job.request))

    async def _astream(self, job: Job, handle: RequestHandle) -> AsyncIterator[str | Usage]:
        """The async twin of `_stream`: an engine error, a cancellation or a cut constrained answer
        raises at the end of the stream, as it does for the sync stream and the whole result."""
        try:
            async for delta in AsyncEngine.deltas(handle):
                yield delta
            output = handle.result()
            self._check(job, output)
            yield _usage(output)  # AsyncTextStream keeps it as its .usage
        finally:
            handle.cancel()  # the caller stopped early: free the sequence (no-op when finished)


class _Chunks:
    """`_astream`'s generator over a submitted request, whose `aclose` cancels the request even when
    the generator never started (closing an async generator before its first step skips its
    `finally`): a stream closed before its first read frees its place in the engine."""

    __slots__ = ("_chunks", "_handle")

    def __init__(self, chunks: AsyncIterator[str | Usage], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> str | Usage:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            self._handle.cancel()  # a no-op once finished


def _usage(output: RequestOutput) -> Usage:
    return Usage(output.num_prompt_tokens, len(output.token_ids), output.finish_reason.value)


def _settings(settings: Mapping | Settings | None, skill: str) -> tuple[Settings, bool]:
    """Validated settings, and whether the caller chose max_tokens (defaults shrink to fit the context)."""
    explicit = isinstance(settings, Settings) or (isinstance(settings, Mapping) and "max_tokens" in settings)
    return validate_settings(settings, skill), explicit
