"""`foveal.load()` and the `Model` facade: Moondream-style skills on foveal's pipelined engine.

PROBLEM
    A user calls `model.detect(image, "car")` from a script, from 8 threads, over a list of 10,000
    images, or from an asyncio server. Every call must check its input before any work, become one
    engine request (prompt ids, image tensors, a grammar matcher, sampling), batch with the other
    calls in flight, and come back as a plain result dict; a bad call must never disturb the engine
    or the other calls.
SOLUTION
    One `Engine` per `Model`. A call goes through three steps:
      1. task: arguments and settings are checked and the family's `Skills` turn them into a
         `Task` (prompt text, output spec, parser), skills.py;
      2. prepare: the output spec is compiled (SchemaError here), the image is decoded and keyed
         (ImageError here), the family's processor builds prompt ids and image tensors, and the
         token budget is checked against the engine's context: a `Job` holding a `Request`;
      3. submit and collect: the engine batches every request in flight (from any thread); the
         caller blocks on its handle (or iterates its text deltas, or awaits it), then the task's
         parser turns the text into the result dict.
    Steps 1-2 run on the caller's thread; the processor, the tokenizer and grammar compilation are
    used under one lock (fast tokenizers must not be shared by threads mid-call), while decoding
    runs concurrently in the engine. The engine gets its own copy of the tokenizer.
    Lists of images go through the same steps with a bounded window of requests in flight.
INVARIANTS (tests/sdk/test_model.py, test_concurrency.py)
    1. Every bad input raises before a request is submitted; the engine then serves the next call.
    2. A constrained answer is parsed only when its grammar completed; a cut answer raises
       IncompleteOutputError instead of returning a partial value.
    3. Concurrent calls with the same seeds return what sequential calls return.
    4. Batch results come back in input order; a failed image yields its exception in its place.
    5. Each request with an image carries `extras["image_key"]` (foveal.vision.image_key of the
       decoded image), so a runner can reuse that image's encoding across calls.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from foveal import grammars
from foveal.engine import AsyncEngine, Engine, EngineConfig, FinishReason, Request, SamplingParams
from foveal.engine import models as engine_models
from foveal.engine.kv_cache import pages_needed
from foveal.engine.request import RequestHandle, RequestOutput
from foveal.errors import GenerationError, IncompleteOutputError
from foveal.outputs import output_parser
from foveal.results import (
    CaptionResult,
    DetectResult,
    GenerateResult,
    PointResult,
    QueryResult,
    Result,
)
from foveal.settings import Settings, validate_settings
from foveal.skills import Skills, Task, check_length, check_object, check_text, skills_for
from foveal.vision import image_key, load_image

EMBEDDED = Path(__file__).parent / "embedded"
DEFAULT_MAX_MODEL_LEN = 4096  # tokens per sequence unless the model allows fewer or the caller asks
PAGE_SIZE = 16
SKILLS = ("caption", "query", "detect", "point", "generate")
IMAGE_SKILLS = ("caption", "detect", "point")  # meaningless without an image on a vision model


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image decoded and keyed once (`model.encode_image`); pass it to skills instead of the image."""

    image: Image.Image
    key: str


@dataclass(slots=True)
class Job:
    """One prepared call: its task, the engine request, the decoded image (for the result)."""

    task: Task
    request: Request
    image: Image.Image | None


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
    """
    _check_load_args(pipelined, max_batch_size, max_model_len, kv_cache_bytes)
    source = _model_source(path)
    loaded = engine_models.load(source, device=device, dtype=dtype, image_cache_bytes=image_cache_bytes)
    folder = Path(source) if Path(source).is_dir() else None
    family = loaded.runner.family
    skills = skills_for(
        folder, loaded.family, loaded.tokenizer, family.image_token if family.has_vision else None
    )
    config = engine_config(loaded, pipelined, max_batch_size, max_model_len, kv_cache_bytes)
    return Model(loaded, skills, config)


def _check_load_args(pipelined: Any, max_batch_size: Any, max_model_len: Any, kv_cache_bytes: Any) -> None:
    if not isinstance(pipelined, bool):
        raise TypeError(f"pipelined must be True or False, got {pipelined!r}")
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("max_model_len", max_model_len),
        ("kv_cache_bytes", kv_cache_bytes),
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
            "foveal, or train and export them with `python -m foveal.train_shapes --run runs/shapes "
            f"--export {EMBEDDED}`, or load a checkpoint folder: foveal.load('/path/to/hf_folder')"
        )
    return str(EMBEDDED)


def engine_config(
    loaded: engine_models.LoadedModel,
    pipelined: bool,
    max_batch_size: int,
    max_model_len: int | None,
    kv_cache_bytes: int | None,
) -> EngineConfig:
    """Engine sizes for a loaded model: context length, KV pages (bounded by memory), masks in one call."""
    runner = loaded.runner
    limit = (
        getattr(runner.model.config.get_text_config(), "max_position_embeddings", None)
        or DEFAULT_MAX_MODEL_LEN
    )
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds this model's {limit} positions; lower it")
    model_len = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
    per_sequence = pages_needed(model_len, PAGE_SIZE)
    budget = kv_cache_bytes or engine_models.default_budget_bytes(runner.device)
    num_pages = min(max_batch_size * per_sequence, engine_models.pages_for_budget(runner, budget, PAGE_SIZE))
    if num_pages < per_sequence:
        raise ValueError(
            f"a KV cache of {budget} bytes holds {num_pages} pages; one sequence of {model_len} tokens needs "
            f"{per_sequence}: raise kv_cache_bytes or lower max_model_len"
        )
    return EngineConfig(
        pipelined=pipelined,
        max_batch=max_batch_size,
        max_step_tokens=max(model_len, max_batch_size),
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        max_model_len=model_len,
        eos_token_ids=tuple(loaded.eos_token_ids),
        fill_masks=grammars.fill_masks,
    )


# ---- the facade ---------------------------------------------------------------------------------------------


class Model:
    """A loaded model and its engine. Thread-safe: calls from many threads batch together.

    Skills take `image` as a PIL image, a path, bytes, an HxWx3 uint8 array, an `EncodedImage`,
    or (text-only models, and query/generate on vision models that accept it) None. A list of
    images runs the skill on each (see `map`). Results are dicts (foveal.results).
    """

    def __init__(self, loaded: engine_models.LoadedModel, skills: Skills, config: EngineConfig) -> None:
        self.loaded = loaded
        self.skills = skills
        self.config = config
        self.engine = Engine(loaded.runner, copy.deepcopy(loaded.tokenizer), config)
        self._lock = threading.Lock()  # processor, tokenizer and grammar compiles: one caller at a time

    def __repr__(self) -> str:
        return f"Model(family={self.loaded.family!r}, skills={self.skills.name!r}, source={self.loaded.source!r})"

    def close(self) -> None:
        """Stop the engine; calls still running end with GenerationError."""
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
        self, image: Any, question: str, stream: bool = False, settings: Mapping | None = None
    ) -> QueryResult:
        """Answer a question about the image: `{"answer": str}` (or an iterator of chunks with stream=True)."""
        return self._dispatch(*self._query_task(question, settings), image, stream)

    def detect(self, image: Any, object: str, settings: Mapping | None = None) -> DetectResult:
        """Boxes of every `object`: `{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}`, floats in [0, 1].

        settings: max_objects (at most that many boxes), temperature, top_p, max_tokens, seed.
        """
        return self._dispatch(*self._detect_task(object, settings), image, False)

    def point(self, image: Any, object: str, settings: Mapping | None = None) -> PointResult:
        """Points on every `object`: `{"points": [{"x", "y"}]}`, floats in [0, 1], origin top-left."""
        return self._dispatch(*self._point_task(object, settings), image, False)

    def generate(
        self, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
    ) -> GenerateResult:
        """Answer `prompt` in the shape of `output_type`: `{"text": str, "output": parsed value}`.

        output_type: None (free text), a pydantic model class (output: an instance), a JSON-schema
        dict (output: a dict), foveal.Regex / foveal.CFG / typing.Literal (output: the str or
        literal), or any other type foveal.grammars accepts (see foveal.outputs).
        """
        return self._dispatch(*self._generate_task(prompt, output_type, settings), image, False)

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
        """Decode and key an image once, for several calls on it (Moondream's `encode_image`)."""
        if isinstance(image, EncodedImage):
            return image
        decoded = load_image(image)
        return EncodedImage(decoded, image_key(decoded))

    # ---- async skills ----------------------------------------------------------------------------------------

    async def acaption(
        self, image: Any, length: str = "normal", stream: bool = False, settings: Mapping | None = None
    ) -> CaptionResult:
        """`caption` for asyncio; with stream=True the caption is an async iterator of text chunks."""
        return await self._adispatch(*self._caption_task(length, settings), image, stream)

    async def aquery(
        self, image: Any, question: str, stream: bool = False, settings: Mapping | None = None
    ) -> QueryResult:
        """`query` for asyncio; with stream=True the answer is an async iterator of text chunks."""
        return await self._adispatch(*self._query_task(question, settings), image, stream)

    async def adetect(self, image: Any, object: str, settings: Mapping | None = None) -> DetectResult:
        """`detect` for asyncio."""
        return await self._adispatch(*self._detect_task(object, settings), image, False)

    async def apoint(self, image: Any, object: str, settings: Mapping | None = None) -> PointResult:
        """`point` for asyncio."""
        return await self._adispatch(*self._point_task(object, settings), image, False)

    async def agenerate(
        self, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
    ) -> GenerateResult:
        """`generate` for asyncio."""
        return await self._adispatch(*self._generate_task(prompt, output_type, settings), image, False)

    # ---- step 1: tasks (arguments and settings, no image) -----------------------------------------------------

    def _caption_task(self, length: str = "normal", settings: Mapping | None = None) -> tuple:
        s, explicit = _settings(settings, "caption")
        return self.skills.caption(check_length(length)), s, explicit

    def _query_task(self, question: str, settings: Mapping | None = None) -> tuple:
        s, explicit = _settings(settings, "query")
        return self.skills.query(check_text("question", question, 2000).strip()), s, explicit

    def _detect_task(self, object: str, settings: Mapping | None = None) -> tuple:
        s, explicit = _settings(settings, "detect")
        return self.skills.detect(check_object(object), s.max_objects), s, explicit

    def _point_task(self, object: str, settings: Mapping | None = None) -> tuple:
        s, explicit = _settings(settings, "point")
        return self.skills.point(check_object(object), s.max_objects), s, explicit

    def _generate_task(self, prompt: str, output_type: Any = None, settings: Mapping | None = None) -> tuple:
        s, explicit = _settings(settings, "generate")
        check_text("prompt", prompt)
        return self.skills.generate(prompt, output_type, output_parser(output_type)), s, explicit

    # ---- step 2: prepare (grammar, image, prompt ids, token budget) -------------------------------------------

    def _prepare(self, task: Task, image: Any, settings: Settings, explicit: bool) -> Job:
        with self._lock:
            automaton = self._compile(task.spec)
        decoded, key = self._image(image, task.skill)
        with self._lock:
            prompt = self.loaded.processor(task.prompt, decoded)
        extras = prompt.extras
        if key is not None:
            extras["image_key"] = key
        sampling = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=self._budget(len(prompt.token_ids), settings.max_tokens, explicit),
            seed=settings.seed,
        )
        matcher = automaton.matcher() if automaton is not None else None
        return Job(task, Request(prompt.token_ids, sampling, matcher, extras), decoded)

    def _compile(self, spec: Any) -> grammars.Automaton | None:
        if spec is None:
            return None
        return grammars.compile(spec, self.loaded.tokenizer, vocab_size=self.loaded.runner.vocab_size)

    def _image(self, image: Any, skill: str) -> tuple[Image.Image | None, str | None]:
        family = self.loaded.runner.family
        if image is None:
            if family.has_vision and (skill in IMAGE_SKILLS or family.prefix_attention):
                raise ValueError(f"{skill} on this {family.name} model needs an image; pass image=...")
            return None, None
        if not family.has_vision:
            raise ValueError(f"this {family.name} model is text-only; pass image=None")
        if isinstance(image, EncodedImage):
            return image.image, image.key
        decoded = load_image(image)
        return decoded, image_key(decoded)

    def _budget(self, prompt_len: int, max_tokens: int, explicit: bool) -> int:
        """max_tokens for this prompt: a skill's default shrinks to the context; an explicit one must fit."""
        room = self.config.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, more than this model's context of "
                f"{self.config.max_model_len}; shorten it or load with a larger max_model_len"
            )
        if explicit and max_tokens > room:
            raise ValueError(
                f"settings['max_tokens']={max_tokens} does not fit: the prompt has {prompt_len} tokens and the "
                f"context is {self.config.max_model_len}; use max_tokens <= {room}"
            )
        return min(max_tokens, room)

    # ---- step 3: submit and collect --------------------------------------------------------------------------

    def _dispatch(self, task: Task, settings: Settings, explicit: bool, image: Any, stream: bool) -> Any:
        if isinstance(image, list | tuple):
            if stream:
                raise ValueError("stream=True takes one image, not a list")
            return self._batch(task, list(image), settings, explicit, progress=None)
        job = self._prepare(task, image, settings, explicit)
        handle = self.engine.submit(job.request)
        if stream:
            return _make(task.skill, "", self._stream(job, handle), job.image)
        return self._result(job, handle.result())

    def _stream(self, job: Job, handle: RequestHandle) -> Iterator[str]:
        try:
            yield from handle
            self._check(job, handle.result())
        finally:
            handle.cancel()  # the caller stopped early: free the sequence (no-op when finished)

    def _result(self, job: Job, output: RequestOutput) -> Result:
        self._check(job, output)
        text = output.text
        if job.task.keep_special:
            with self._lock:
                text = self.loaded.tokenizer.decode(output.token_ids, skip_special_tokens=False)
        return _make(job.task.skill, output.text, job.task.parse(text), job.image)

    @staticmethod
    def _check(job: Job, output: RequestOutput) -> None:
        if output.finish_reason is FinishReason.ERROR:
            raise GenerationError(f"{job.task.skill} failed in the engine: {output.error}")
        if output.finish_reason is FinishReason.CANCELLED:
            raise GenerationError(
                f"{job.task.skill} was cancelled (the model was closed or the call cancelled)"
            )
        if output.finish_reason is FinishReason.LENGTH and job.task.spec is not None:
            raise IncompleteOutputError(job.task.skill, job.request.sampling.max_tokens, output.text)

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
                    job = self._prepare(task, image, settings, explicit)
                    window.append((index, job, self.engine.submit(job.request)))
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
            calls = [self._adispatch(task, settings, explicit, one, False) for one in image]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        job = await asyncio.to_thread(self._prepare, task, image, settings, explicit)
        if stream:
            return _make(task.skill, "", self._astream(job), job.image)
        return self._result(job, await AsyncEngine(self.engine).generate(job.request))

    async def _astream(self, job: Job) -> AsyncIterator[str]:
        """The async twin of `_stream`: an engine error, a cancellation or a cut constrained answer
        raises at the end of the stream, as it does for the sync stream and the whole result."""
        handle = self.engine.submit(job.request)
        try:
            async for delta in AsyncEngine.deltas(handle):
                yield delta
            self._check(job, handle.result())
        finally:
            handle.cancel()  # the caller stopped early: free the sequence (no-op when finished)


def _settings(settings: Mapping | Settings | None, skill: str) -> tuple[Settings, bool]:
    """Validated settings, and whether the caller chose max_tokens (defaults shrink to fit the context)."""
    explicit = isinstance(settings, Settings) or (isinstance(settings, Mapping) and "max_tokens" in settings)
    return validate_settings(settings, skill), explicit


def _make(skill: str, text: str, value: Any, image: Image.Image | None) -> Result:
    if skill == "caption":
        return CaptionResult(value, image=image)
    if skill == "query":
        return QueryResult(value, image=image)
    if skill == "detect":
        return DetectResult(value, image=image)
    if skill == "point":
        return PointResult(value, image=image)
    return GenerateResult(text, value, image=image)
