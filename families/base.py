"""`Family`: the plugin contract between the SDK and one model family, and what every family shares.

PROBLEM
    A skill call (`caption`, `query`, `detect`, `point`, `generate`, `chat`) means the same thing on
    every model, but each family was trained to be asked differently, answers in its own format, may
    need its own runner and processor, and decodes under its own rules. The SDK must run every
    family without naming one, and adding a family must not touch the SDK, the grammars or the engine.
SOLUTION
    A family is one object, built at load (`foveal.families.load`) and carried by the loaded model. It
    owns the loaded checkpoint (runner, tokenizer, processor, eos ids), declares what it can do
    (`Capabilities`), turns each skill call into a `Task` (prompt, output spec, parser), renders and
    encodes a task's prompt with the call's images into engine inputs (`encode`), compiles the
    output spec (`compile`: grammars.compile, or the family's own answer automaton) and says how a
    step's masks are filled (`fill_masks`). The SDK checks arguments and settings, calls these, and
    submits to the engine; it reads nothing else of a family.
INVARIANTS
    - Every method that takes user text refuses text the tokenizer would read as one of its special
      or added tokens (`plain`), before any work: user text can never smuggle control tokens into a
      prompt or an answer's grammar.
    - A skill a family does not declare raises `UnsupportedSkill` (a ValueError) naming what it does
      support; `capabilities.skills` is exactly the set of skills that do not.
    - Families are used from many threads at once: nothing here mutates shared state per call.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

from PIL import Image

from foveal import grammars
from foveal.engine.matcher import FillMasks, Matcher
from foveal.engine.models.loader import LoadedModel, LoadOptions
from foveal.engine.models.processor import PromptInputs
from foveal.engine.request import Request
from foveal.engine.runner import describe
from foveal.families.conversation import Conversation
from foveal.families.prepared import (
    AnswerAutomaton,
    CallLimits,
    ImagesOf,
    Prepared,
    fixed_start_error,
    items_error,
    reader,
)
from foveal.families.reserved import ReservedMask, ReservedTokens
from foveal.families.scores import SCORE_ALTERNATIVES
from foveal.families.task import Task
from foveal.grammars import spatial
from foveal.grammars.cache import LRUCache

ALL_SKILLS = ("caption", "query", "detect", "point", "generate", "chat", "segment")
IMAGE_SKILLS = ("caption", "detect", "point", "segment")  # meaningless without an image


class CallSettings(Protocol):
    """What a family reads of a call's settings beyond sampling (`foveal.settings.Settings`)."""

    @property
    def variant(self) -> str | None: ...

    @property
    def adapter(self) -> str | None: ...


class UnsupportedSkill(ValueError):
    """A skill, an input or an option this family does not support; the message says what it does."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    skills: frozenset[str]  # the skills this family answers
    vision: bool  # takes images
    image_required: bool = False  # every call needs an image (no text-only prompts)
    max_images: int = 1  # images one call may carry (0: text-only)
    conversations: bool = False  # system turns and several turns, rendered by the model's own template
    reasoning: bool = False  # query(reasoning=True): a grounded reasoning before the answer
    gaze: bool = False  # detect_gaze(image, eye=(x, y))
    spatial_refs: frozenset[str] = frozenset()  # the skills that take spatial_refs (points / boxes in the prompt)
    variants: bool = False  # settings["variant"]: a LoRA adapter per request
    token_budget: int | None = None  # default max_tokens of caption / query answers; None: the SDK's


class Family:
    """The base of every family plugin (see the module docstring). Subclasses set `name` and
    `capabilities`, implement `matches` / `load` for the registry and the skills they declare."""

    name: str = "base"  # the family's name, for messages (a class attribute, or set per instance)
    architectures: ClassVar[tuple[str, ...]] = ()  # config.json architectures this family loads
    # whether `load` can tell a local folder's revision and check a pinned one (LoadOptions.revision)
    checks_revision: ClassVar[bool] = False

    def __init__(self, loaded: LoadedModel, capabilities: Capabilities) -> None:
        self.runner = loaded.runner
        self.tokenizer = loaded.tokenizer
        self.processor = loaded.processor
        self.eos_token_ids = loaded.eos_token_ids
        self.source = loaded.source
        self.capabilities = capabilities
        self._special = _special_pattern(special_texts(loaded.tokenizer))
        self._bounds: LRUCache[spatial.ItemTokenBounds] = LRUCache(maxsize=256)
        self._reserved: ReservedMask | None = None  # `reserve`: the family's reserved tokens

    def runner_description(self) -> str:
        """Which runner computes this model's forward, on which kernels (engine.runner.describe)."""
        return describe(self.runner)

    @property
    def image_min_size(self) -> tuple[int, int] | None:
        """(width, height) the model's image processor shrinks every image to at least, so an image may
        be decoded reduced down to it (`foveal.vision.load_image(min_size=)`); None where the
        processing depends on the image's own size (then images are decoded in full). Default: read
        from a fixed-size transformers image processor."""
        image_processor = getattr(getattr(self.processor, "hf_processor", None), "image_processor", None)
        return fixed_size(image_processor) if self.capabilities.vision else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source={self.source!r})"

    # ---- the registry's hooks ---------------------------------------------------------------------------------

    @classmethod
    def matches(cls, raw: dict, folder: Path) -> bool:
        """Whether this family loads the checkpoint folder whose config.json is `raw`."""
        return any(arch in cls.architectures for arch in raw.get("architectures") or [])

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> Family:
        raise NotImplementedError

    # ---- skills: a call -> a Task -----------------------------------------------------------------------------

    def caption(self, length: str) -> Task:
        raise self.unsupported("caption")

    def query(self, question: str) -> Task:
        raise self.unsupported("query")

    def detect(self, phrase: str, max_objects: int) -> Task:
        raise self.unsupported("detect")

    def point(self, phrase: str, max_objects: int) -> Task:
        raise self.unsupported("point")

    def generate(self, prompt: str, output_type: Any) -> Task:
        raise self.unsupported("generate")

    def chat(self, conversation: Conversation, output_type: Any) -> Task:
        raise self.unsupported("chat")

    # ---- optional skills (families that declare them in their capabilities override these) ---------------

    def spatial_query(self, question: str, refs: tuple[tuple[float, ...], ...]) -> Task:
        raise self.unsupported_option("spatial_refs on query", self.refs_hint())

    def spatial_point(self, phrase: str, max_objects: int, refs: tuple[tuple[float, ...], ...]) -> Task:
        """point with spatial references in the prompt (families with "point" in capabilities.spatial_refs)."""
        raise self.unsupported_option("spatial_refs on point", self.refs_hint())

    def reasoning(self, question: str, refs: tuple[tuple[float, ...], ...] | None) -> Task:
        """The reasoning phase of query(reasoning=True); its ids go to `reasoned_answer`."""
        raise self.unsupported("reasoning")

    def reasoned_answer(self, task: Task, token_ids: list[int]) -> tuple[dict[str, Any], Task]:
        """(the reasoning dict read from the reasoning task's ids, the answer's task)."""
        raise self.unsupported("reasoning")

    def detect_gaze(self, eye: tuple[float, float]) -> Task:
        raise self.unsupported("detect_gaze")

    def segment(self, phrase: str, refs: tuple[tuple[float, ...], ...] | None) -> Task:
        """The object's mask: a Task of skill "segment" whose value (its `parse` of the whole answer's
        text) is `{"path": SVG path data in normalized coordinates, "bbox": {"x_min", "y_min",
        "x_max", "y_max"}}`, and whose `progress` reads a streamed answer's text so far (Task)."""
        raise self.unsupported("segment")

    def with_settings(self, task: Task, settings: CallSettings) -> Task:
        """The task with what the call's settings say beyond sampling (a LoRA variant, an adapter)."""
        if settings.variant is not None:
            raise self.unsupported_option("settings['variant'] (LoRA variants)", "remove it")
        if settings.adapter is not None:
            raise self.unsupported_option("settings['adapter'] (fine-tune adapters)", "remove it")
        return task

    def refs_hint(self) -> str:
        """Where this family takes spatial_refs, for refusals."""
        skills = sorted(self.capabilities.spatial_refs)
        return f"it takes them on {', '.join(skills)}" if skills else "remove spatial_refs"

    def unsupported_option(self, what: str, instead: str) -> UnsupportedSkill:
        return UnsupportedSkill(f"this {self.name} model does not support {what}; {instead}")

    # ---- chat: what the family's chat template (a `ChatTemplate` as `self.template`, if any) says --------
    @property
    def tool_format(self) -> str:
        """How tool calls are written: "hermes" where the chat template writes `<tool_call>` itself,
        else foveal's documented "json" format (foveal.tools)."""
        template = getattr(self, "template", None)
        return template.tool_format if template is not None else "json"

    @property
    def thinking(self) -> str | None:
        """The chat template's thinking section (ChatTemplate.reasoning), or None where it has none."""
        template = getattr(self, "template", None)
        return template.reasoning if template is not None else None

    def unsupported(self, skill: str) -> UnsupportedSkill:
        supported = ", ".join(s for s in ALL_SKILLS if s in self.capabilities.skills)
        if not self.capabilities.vision and skill in IMAGE_SKILLS:
            return UnsupportedSkill(f"this {self.name} model is text-only: {skill} needs an image; use {supported}")
        return UnsupportedSkill(f"this {self.name} model does not support {skill}; it supports {supported}")

    # ---- running a task ---------------------------------------------------------------------------------------

    def prepare(self, task: Task, images: ImagesOf, limits: CallLimits) -> Prepared:
        """The call made whole (families/prepared.py): its output spec compiled (a spatial answer's once
        its item count is sized to the budget the prompt leaves), its prompt encoded with the call's
        images (decoded by `images()` only then), its request, and how its output reads."""
        spatial_answer = isinstance(task.spec, spatial.SpatialSpec)
        # other specs compile first: a bad output type fails before the images are encoded
        automaton = None if spatial_answer else self.compile(task.spec)
        decoded, image_key = images()
        prompt, task = self.encode(task, decoded, image_key)
        prompt_len = len(prompt.token_ids)
        max_tokens = limits.budget(prompt_len)
        if spatial_answer:
            fitted, one = self.fit_items(task, max_tokens)
            if fitted is None:
                raise items_error(task.skill, max_tokens, one, prompt_len, limits.max_model_len)
            task = fitted
            automaton = self.compile(task.spec)
        if automaton is not None and automaton.min_tokens > max_tokens:
            raise fixed_start_error(automaton.min_tokens, max_tokens)
        sampling = replace(
            limits.sampling,
            max_tokens=max_tokens,
            skip_special_tokens=not task.keep_special,  # the text the parser reads, made by the engine
            # what the scores read; else what the caller asked for (chat's logprobs)
            logprobs=SCORE_ALTERNATIVES if task.score is not None else limits.sampling.logprobs,
        )
        request = Request(prompt.token_ids, sampling, self._matcher(task, automaton), prompt.prefill)
        read = reader(task, automaton, frozenset(self.eos_token_ids), limits.min_score)
        return Prepared(task, request, read, decoded[0] if decoded else None)

    def _matcher(self, task: Task, automaton: AnswerAutomaton | None) -> Matcher | None:
        """One call's matcher: its automaton's; else the task's own decode rules; else free text's,
        which masks the family's reserved tokens (None where it has none: no mask at all)."""
        if automaton is not None:
            return automaton.matcher()
        if task.rules is not None:
            return task.rules()
        return self.free_text_matcher()

    def encode(self, task: Task, images: list[Image.Image], image_key: str | None) -> tuple[PromptInputs, Task]:
        """The engine inputs of `task` with the call's decoded images (in order), and the task as it
        applies to them (a family whose answer's scale depends on the processed image rebinds it)."""
        return self.processor(task.prompt, images or None, image_key=image_key), task

    def compile(self, spec: Any) -> AnswerAutomaton | None:
        """The automaton of an output spec (cached by grammars.compile), or None for free text."""
        if spec is None:
            return None
        return grammars.compile(spec, self.tokenizer, vocab_size=self.runner.vocab_size)

    def fit_items(self, task: Task, max_tokens: int) -> tuple[Task | None, int]:
        """(the task with its spatial answer's max_objects lowered to the items whose every complete
        answer fits in `max_tokens`, or None when not even one does; the most tokens one item's answer
        takes). Sized by the grammar's worst case (`grammars.spatial.item_token_bounds`): the model
        may spell the phrase and separators with more tokens than their canonical tokenization."""
        spec = task.spec
        bounds = self.item_bounds(spec)
        fits = bounds.items_within(max_tokens)
        if fits < 1:
            return None, bounds.first
        if fits >= spec.max_objects:
            return task, bounds.first
        return replace(task, spec=replace(spec, max_objects=fits)), bounds.first

    def item_bounds(self, spec: spatial.SpatialSpec) -> spatial.ItemTokenBounds:
        """`item_token_bounds` of a spatial spec, cached: the same skill and phrase are asked again and
        again, and the bounds do not depend on max_objects."""
        key = replace(spec, max_objects=1).cache_key()
        bounds = self._bounds.get(key)
        if bounds is None:
            bounds = spatial.item_token_bounds(spec, self.tokenizer, vocab_size=self.runner.vocab_size)
            self._bounds.put(key, bounds)
        return bounds

    def reserve(self, ids: tuple[int, ...]) -> None:
        """Mark tokens that belong to this family's answer formats only (PaliGemma's location
        tokens): free text never holds them (`free_text_matcher`). Called once, at construction."""
        self._reserved = ReservedMask(self.runner.vocab_size, ids) if ids else None

    @property
    def reserved_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._reserved.ids)) if self._reserved is not None else ()

    def free_text_matcher(self) -> ReservedTokens | None:
        """The matcher of an answer decoded without a grammar: None (no mask at all), or, where the
        family reserves tokens, one that masks them (families/reserved.py)."""
        return self._reserved.matcher() if self._reserved is not None else None

    @property
    def fill_masks(self) -> FillMasks:
        """How one step's masks are filled: one native call over every row."""
        return grammars.fill_masks

    # ---- user text ---------------------------------------------------------------------------------------------

    def plain_conversation(self, conversation: Conversation) -> Conversation:
        """`conversation` if every text part of it is plain text (`plain`); ValueError otherwise."""
        for message in conversation:
            for part in message.parts:
                if isinstance(part, str):
                    self.plain("message", part)
        return conversation

    def plain(self, name: str, text: str) -> str:
        """`text` if it is plain text for this model's tokenizer; ValueError naming the token otherwise."""
        found = self._special.search(text) if self._special else None
        if found:
            raise ValueError(
                f"{name} {text!r} holds {found[0]!r}, a special token of this model's tokenizer; "
                "user text must be plain text: remove it or spell it differently"
            )
        return text


def fixed_size(image_processor: Any) -> tuple[int, int] | None:
    """The size a transformers image processor resizes every image to (at least), if it has one."""
    size = getattr(image_processor, "size", None)
    get = (lambda key: size.get(key)) if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    if get("height") and get("width"):
        return int(get("width")), int(get("height"))
    edge = get("shortest_edge") or get("longest_edge")
    return (int(edge), int(edge)) if isinstance(edge, int) and edge > 0 else None


def special_texts(tokenizer: Any) -> list[str]:
    """Texts the tokenizer turns into one special or added token (what user text must not hold)."""
    if tokenizer is None:
        return []
    texts = list(getattr(tokenizer, "all_special_tokens", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts += [str(getattr(token, "content", token)) for token in added.values()]
    return texts


def _special_pattern(texts: Iterable[str]) -> re.Pattern | None:
    ordered = sorted({t for t in texts if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None
