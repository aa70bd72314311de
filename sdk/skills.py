"""Skills per model family: for each call, the prompt text, the output grammar and the parser.

A skill call (`caption`, `query`, `detect`, `point`, `generate`) means the same thing on every
model, but each family was trained to be asked differently. A `Skills` object turns a call into a
`Task`: the prompt the family's processor receives, the output spec that `foveal.grammars`
compiles into the decoding mask, and the parser from the model's text to the result's value.

Families (chosen by `skills_for`):
- `ShapesSkills`: the embedded shapes model (a PaliGemma folder with `foveal.json`). Prompts come
  from `foveal.json`; detect and point answer in location tokens (`<locNNNN>`, N bins from
  `foveal.json`) followed by the object phrase, the format the model was trained on.
- `PaliGemmaSkills`: real PaliGemma checkpoints with their own task prefixes: "caption en"
  (short, normal) and "describe en" (long), "answer en Q", "detect X" with 1024 location bins.
  PaliGemma has no pointing task, so `point` asks "detect X" and answers with the box centres.
- `ChatSkills`: chat/instruct families (llama, gemma, idefics3, llava). The prompt is the
  tokenizer's chat template (one user turn, generation prompt added) when it has one, a plain
  "Question: ...\\nAnswer:" layout otherwise; detect and point answer in the JSON shapes of
  `foveal.grammars.spatial` (coordinates in [0, 1]).

Every spatial answer is constrained, so it parses by construction: boxes have x_min < x_max and
y_min < y_max, coordinates lie in [0, 1], and there are at most `max_objects` items. A parser that
fails anyway (the grammar let through what the parser refuses: a bug) raises GenerationError naming
the skill, never a bare parser exception.

User text (object phrases, questions, prompts) is plain text: text that the tokenizer would read as
one of its special or added tokens (`<image>`, `<eos>`, `<loc0005>`) is refused before any work, so
that a phrase can never smuggle control tokens into the prompt or the answer's grammar. An object
phrase that would make a location-token answer ambiguous (holding the item separator) is refused
too (`foveal.grammars.locations`).

No family uses the shared tokenizer per call: what a family needs from it (the chat template's
layout, whether tokenizing adds BOS, the special-token texts) is computed once at construction.
The model serializes the tokenizer's own uses under its lock; skills run on the callers' threads.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from foveal.errors import GenerationError
from foveal.grammars import spatial
from foveal.grammars.locations import LocationFormat
from foveal.results import CaptionResult, DetectResult, GenerateResult, PointResult, QueryResult, Result
from foveal.shapes_format import FORMAT_FILE, ShapesFormat

CAPTION_LENGTHS = ("short", "normal", "long")
MAX_PHRASE_CHARS = 200


@dataclass(frozen=True, slots=True)
class Task:
    """One skill call made concrete for a family: result type, prompt text, output spec, parser of the answer."""

    result: type[Result]  # CaptionResult, QueryResult, DetectResult, PointResult or GenerateResult
    prompt: str
    spec: Any = None  # an output spec for grammars.compile; None: free text
    parse: Callable[[str], Any] | None = None  # the model's text -> the value; None: the compiled spec's own
    keep_special: bool = False  # parse the text with special tokens kept (location tokens may be special)
    prompt_without_image: str | None = None  # the prompt when the call has no image (None: `prompt`)
    # (task, processed prompt) -> the task for that prompt, where the answer's scale depends on the
    # processed image (Qwen2.5-VL answers in pixels of the resized input: qwen_skills.py); None: as is
    for_prompt: Callable[[Task, Any], Task] | None = None
    # Free text under the family's own decode rules: a factory of one call's matcher (Moondream masks
    # its answer id after the first token). None: unconstrained. Used only when `spec` is None.
    rules: Callable[[], Any] | None = None

    @property
    def skill(self) -> str:
        return self.result.SKILL

    def parser(self, automaton: Any) -> Callable[[str], Any]:
        """The parser of this task's answer: its own, or else the compiled output spec's (`Automaton.parse`,
        plain text without a spec). Its failures are GenerationErrors naming the skill."""
        if self.parse is not None:
            return self.parse
        return _guarded(self.skill, automaton.parse if automaton is not None else str)

    def prompt_for(self, has_image: bool) -> str:
        """The prompt text for a call with or without an image (vision chat prompts hold a placeholder)."""
        if has_image or self.prompt_without_image is None:
            return self.prompt
        return self.prompt_without_image


# ---- argument checks (shared by every family; raise before any work) ----------------------------------------


def check_length(length: Any) -> str:
    if length not in CAPTION_LENGTHS:
        raise ValueError(f"length={length!r} is not accepted; use one of {', '.join(CAPTION_LENGTHS)}")
    return length


def check_text(name: str, value: Any, max_chars: int | None = None) -> str:
    """A non-empty, single-line string argument (object phrase, question, prompt)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} is empty; pass some text, e.g. {_EXAMPLES.get(name, 'a word')!r}")
    if max_chars is not None:
        if len(value) > max_chars:
            raise ValueError(f"{name} has {len(value)} characters; keep it under {max_chars}")
        if any(c in value for c in "\n\r\t"):
            raise ValueError(f"{name} must be one line (no newline or tab): {value!r}")
    return value


_EXAMPLES = {"object": "red circle", "question": "how many shapes are there?", "prompt": "describe the image"}


def check_object(value: Any) -> str:
    return check_text("object", value, MAX_PHRASE_CHARS).strip()


# ---- families --------------------------------------------------------------------------------------------------


class Skills:
    """The interface every family implements (see the module docstring).

    `special_tokens`: texts the tokenizer reads as one token of its own (special and added tokens);
    user text holding one is refused (`plain`).
    """

    name = "base"

    def __init__(self, special_tokens: Iterable[str] = ()) -> None:
        texts = sorted({t for t in special_tokens if t}, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, texts))) if texts else None

    def caption(self, length: str) -> Task:
        raise NotImplementedError

    def query(self, question: str) -> Task:
        raise NotImplementedError

    def detect(self, phrase: str, max_objects: int) -> Task:
        raise NotImplementedError

    def point(self, phrase: str, max_objects: int) -> Task:
        raise NotImplementedError

    def generate(self, prompt: str, output_type: Any) -> Task:
        """The answer is parsed by the compiled output type's own parser (Task.parser)."""
        return Task(GenerateResult, self.plain("prompt", prompt), output_type, None, _is_loc(output_type))

    def plain(self, name: str, text: str) -> str:
        """`text` if it is plain text for this model's tokenizer; ValueError naming the token otherwise."""
        found = self._special.search(text) if self._special else None
        if found:
            raise ValueError(
                f"{name} {text!r} holds {found[0]!r}, a special token of this model's tokenizer; "
                "user text must be plain text: remove it or spell it differently"
            )
        return text


class ShapesSkills(Skills):
    """The embedded shapes model: prompts and location-token answers from its `foveal.json`."""

    name = "shapes"

    def __init__(self, fmt: ShapesFormat, special_tokens: Iterable[str] = ()) -> None:
        super().__init__(special_tokens)
        self.fmt = fmt

    def caption(self, length: str) -> Task:
        return Task(CaptionResult, self.fmt.prompt("caption", length=length))

    def query(self, question: str) -> Task:
        return Task(QueryResult, self.fmt.prompt("query", question=self.plain("question", question)))

    def detect(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects, self._label(phrase), self.fmt.n_bins, self.fmt.separator)
        return _spatial_task(DetectResult, self.fmt.prompt("detect", object=phrase), spec)

    def point(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.points("loc", max_objects, self._label(phrase), self.fmt.n_bins, self.fmt.separator)
        return _spatial_task(PointResult, self.fmt.prompt("point", object=phrase), spec)

    def _label(self, phrase: str) -> str:
        return self.fmt.locations.check_label(self.plain("object", phrase))


class PaliGemmaSkills(Skills):
    """Real PaliGemma checkpoints: the task prefixes they were trained on, 1024 location bins."""

    name = "paligemma"
    BINS = 1024
    CAPTION = {"short": "caption en", "normal": "caption en", "long": "describe en"}

    def caption(self, length: str) -> Task:
        return Task(CaptionResult, self.CAPTION[length])

    def query(self, question: str) -> Task:
        return Task(QueryResult, f"answer en {self.plain('question', question)}")

    def detect(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects=max_objects, label=self._label(phrase), bins=self.BINS)
        return _spatial_task(DetectResult, f"detect {phrase}", spec)

    def point(self, phrase: str, max_objects: int) -> Task:
        # PaliGemma has no pointing task: point at the centres of the boxes "detect" finds.
        spec = spatial.boxes("loc", max_objects=max_objects, label=self._label(phrase), bins=self.BINS)
        parse = _guarded("point", lambda text: _box_centres(spatial.parse(spec, text)))
        return Task(PointResult, f"detect {phrase}", spec, parse, True)

    def _label(self, phrase: str) -> str:
        return LocationFormat(self.BINS).check_label(self.plain("object", phrase))


class ChatSkills(Skills):
    """Chat/instruct families: chat template (or a plain layout), JSON spatial answers."""

    name = "chat"
    CAPTION = {
        "short": "Describe this image in one short sentence.",
        "normal": "Describe this image.",
        "long": "Describe this image in detail.",
    }

    def __init__(self, tokenizer: Any, image_token: str | None) -> None:
        super().__init__(special_texts(tokenizer))
        self.image_token = image_token
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        # Everything the prompts need from the tokenizer, read now: calls run on the callers' threads,
        # and a fast tokenizer must not be used by two threads mid-call.
        self._layout = _turn_layout(tokenizer) if self.has_template else None
        self._renderer = _LockedRenderer(tokenizer) if self.has_template and self._layout is None else None

    def caption(self, length: str) -> Task:
        return self._task(CaptionResult, self.CAPTION[length])

    def query(self, question: str) -> Task:
        return self._task(QueryResult, self.plain("question", question))

    def detect(self, phrase: str, max_objects: int) -> Task:
        ask = (
            f"Find every {self.plain('object', phrase)} in the image. Answer with JSON "
            '{"objects": [{"x_min": .., "y_min": .., "x_max": .., "y_max": ..}]}, '
            "coordinates normalized to [0, 1] from the top-left corner."
        )
        return self._task(DetectResult, ask, spatial.boxes("json", max_objects=max_objects))

    def point(self, phrase: str, max_objects: int) -> Task:
        ask = (
            f"Point at every {self.plain('object', phrase)} in the image. Answer with JSON "
            '{"points": [{"x": .., "y": ..}]}, coordinates normalized to [0, 1] from the top-left corner.'
        )
        return self._task(PointResult, ask, spatial.points("json", max_objects=max_objects))

    def generate(self, prompt: str, output_type: Any) -> Task:
        return self._task(GenerateResult, self.plain("prompt", prompt), output_type)

    def _task(self, result: type[Result], text: str, spec: Any = None) -> Task:
        """A task whose prompt has the image placeholder, and a second prompt for a call without image."""
        if result in (DetectResult, PointResult):
            task = _spatial_task(result, self.turn(text, image=True), spec)
        else:
            task = Task(result, self.turn(text, image=True), spec, None, _is_loc(spec))
        if not self.image_token:
            return task
        return replace(task, prompt_without_image=self.turn(text, image=False))

    def turn(self, text: str, image: bool = True) -> str:
        """The prompt text of one user turn asking `text` (image placeholder first when there is an image)."""
        if image and self.image_token:
            text = f"{self.image_token}\n{text}"
        if not self.has_template:
            return f"Question: {text}\nAnswer:"
        if self._layout is None:
            return self._renderer(text)
        prefix, suffix = self._layout
        return prefix + text + suffix


def special_texts(tokenizer: Any) -> list[str]:
    """Texts the tokenizer turns into one special or added token (what user text must not hold)."""
    if tokenizer is None:
        return []
    texts = list(getattr(tokenizer, "all_special_tokens", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts += [str(getattr(token, "content", token)) for token in added.values()]
    return texts


_MARKS = ("\x00first question\x00", "\x00second\nquestion\x00")


def _turn_layout(tokenizer: Any) -> tuple[str, str] | None:
    """(prefix, suffix) such that a user turn asking `text` is prefix + text + suffix (BOS removed);
    None when the template does not insert the text verbatim (then it is rendered per call)."""
    layouts = set()
    for mark in _MARKS:
        rendered = _render_turn(tokenizer, mark)
        if rendered.count(mark) != 1:
            return None
        layouts.add(tuple(rendered.split(mark)))
    return layouts.pop() if len(layouts) == 1 else None


def _render_turn(tokenizer: Any, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The processor tokenizes with special tokens; a template that writes BOS would give two.
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bos is not None and tokenizer("").get("input_ids", [])[:1] == [tokenizer.bos_token_id]
    if adds_bos and prompt.startswith(bos):
        return prompt[len(bos) :]
    return prompt


class _LockedRenderer:
    """Per-call template rendering on a private copy of the tokenizer, one caller at a time (for
    templates that transform the user's text, so that no fixed layout exists)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def __call__(self, text: str) -> str:
        with self._lock:
            return _render_turn(self._tokenizer, text)


def skills_for(
    folder: Path | None, family: str, tokenizer: Any, image_token: str | None, processor: Any = None
) -> Skills:
    """The skills of a loaded model: shapes (folder has foveal.json), PaliGemma, Moondream, Qwen-VL, or
    chat. `processor`: the model's input processor (Qwen2.5-VL's answers are on its resized image sizes)."""
    if family == "moondream":
        from foveal.moondream_skills import MoondreamSkills  # lazily: it imports this module

        return MoondreamSkills(tokenizer.moondream_config, tokenizer)
    if folder is not None and (folder / FORMAT_FILE).is_file():
        fmt = ShapesFormat.load(folder)
        if fmt.family != family:
            raise ValueError(
                f"{folder / FORMAT_FILE} describes a {fmt.family!r} model but the checkpoint is {family!r}; "
                "remove foveal.json or export the folder again with python -m foveal.training.train_shapes --export"
            )
        return ShapesSkills(fmt, special_texts(tokenizer))
    if family == "paligemma":
        return PaliGemmaSkills(special_texts(tokenizer))
    if family in ("qwen2_5_vl", "qwen3_vl"):
        from foveal.qwen_skills import QwenSkills  # it builds on ChatSkills, below

        absolute = family == "qwen2_5_vl"
        return QwenSkills(tokenizer, image_token, absolute, processor.resized_sizes if absolute else None)
    return ChatSkills(tokenizer, image_token)


# ---- parsers ----------------------------------------------------------------------------------------------------


def _spatial_task(result: type[Result], prompt: str, spec: spatial.SpatialSpec) -> Task:
    key = "objects" if spec.kind == "boxes" else "points"
    parse = _guarded(result.SKILL, lambda text: spatial.parse(spec, text)[key])
    return Task(result, prompt, spec, parse, spec.encoding == "loc")


def _guarded(skill: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, raising GenerationError naming the skill instead of the parser's own exception."""

    def guarded(text: str) -> Any:
        try:
            return parse(text)
        except Exception as error:
            raise GenerationError(
                f"{skill}: the constrained answer {text[:200]!r} does not parse into the result "
                f"({type(error).__name__}: {error}); the grammar and the parser disagree, please report it"
            ) from error

    return guarded


def _is_loc(spec: Any) -> bool:
    return isinstance(spec, spatial.SpatialSpec) and spec.encoding == "loc"


def _box_centres(result: dict) -> list[dict[str, float]]:
    return [
        {"x": (b["x_min"] + b["x_max"]) / 2, "y": (b["y_min"] + b["y_max"]) / 2} for b in result["objects"]
    ]
