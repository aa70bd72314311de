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
y_min < y_max, coordinates lie in [0, 1], and there are at most `max_objects` items.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foveal.grammars import spatial
from foveal.shapes_format import FORMAT_FILE, ShapesFormat

CAPTION_LENGTHS = ("short", "normal", "long")
MAX_PHRASE_CHARS = 200


@dataclass(frozen=True, slots=True)
class Task:
    """One skill call made concrete for a family: prompt text, output spec, parser of the answer."""

    skill: str  # "caption" | "query" | "detect" | "point" | "generate"
    prompt: str
    spec: Any = None  # an output spec for grammars.compile; None: free text
    parse: Callable[[str], Any] = str  # the model's text -> the result's value
    keep_special: bool = False  # parse the text with special tokens kept (location tokens may be special)


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
    """The interface every family implements (see the module docstring)."""

    name = "base"

    def caption(self, length: str) -> Task:
        raise NotImplementedError

    def query(self, question: str) -> Task:
        raise NotImplementedError

    def detect(self, phrase: str, max_objects: int) -> Task:
        raise NotImplementedError

    def point(self, phrase: str, max_objects: int) -> Task:
        raise NotImplementedError

    def generate(self, prompt: str, output_type: Any, parse: Callable[[str], Any]) -> Task:
        return Task("generate", prompt, output_type, parse, _is_loc(output_type))


class ShapesSkills(Skills):
    """The embedded shapes model: prompts and location-token answers from its `foveal.json`."""

    name = "shapes"

    def __init__(self, fmt: ShapesFormat) -> None:
        self.fmt = fmt

    def caption(self, length: str) -> Task:
        return Task("caption", self.fmt.prompt("caption", length=length))

    def query(self, question: str) -> Task:
        return Task("query", self.fmt.prompt("query", question=question))

    def detect(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects=max_objects, label=phrase, bins=self.fmt.n_bins)
        return _spatial_task("detect", self.fmt.prompt("detect", object=phrase), spec)

    def point(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.points("loc", max_objects=max_objects, label=phrase, bins=self.fmt.n_bins)
        return _spatial_task("point", self.fmt.prompt("point", object=phrase), spec)


class PaliGemmaSkills(Skills):
    """Real PaliGemma checkpoints: the task prefixes they were trained on, 1024 location bins."""

    name = "paligemma"
    BINS = 1024
    CAPTION = {"short": "caption en", "normal": "caption en", "long": "describe en"}

    def caption(self, length: str) -> Task:
        return Task("caption", self.CAPTION[length])

    def query(self, question: str) -> Task:
        return Task("query", f"answer en {question}")

    def detect(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects=max_objects, label=phrase, bins=self.BINS)
        return _spatial_task("detect", f"detect {phrase}", spec)

    def point(self, phrase: str, max_objects: int) -> Task:
        # PaliGemma has no pointing task: point at the centres of the boxes "detect" finds.
        spec = spatial.boxes("loc", max_objects=max_objects, label=phrase, bins=self.BINS)
        return Task(
            "point", f"detect {phrase}", spec, lambda text: _box_centres(spatial.parse(spec, text)), True
        )


class ChatSkills(Skills):
    """Chat/instruct families: chat template (or a plain layout), JSON spatial answers."""

    name = "chat"
    CAPTION = {
        "short": "Describe this image in one short sentence.",
        "normal": "Describe this image.",
        "long": "Describe this image in detail.",
    }

    def __init__(self, tokenizer: Any, image_token: str | None) -> None:
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def caption(self, length: str) -> Task:
        return Task("caption", self.turn(self.CAPTION[length]))

    def query(self, question: str) -> Task:
        return Task("query", self.turn(question))

    def detect(self, phrase: str, max_objects: int) -> Task:
        ask = (
            f"Find every {phrase} in the image. Answer with JSON "
            '{"objects": [{"x_min": .., "y_min": .., "x_max": .., "y_max": ..}]}, '
            "coordinates normalized to [0, 1] from the top-left corner."
        )
        return _spatial_task("detect", self.turn(ask), spatial.boxes("json", max_objects=max_objects))

    def point(self, phrase: str, max_objects: int) -> Task:
        ask = (
            f"Point at every {phrase} in the image. Answer with JSON "
            '{"points": [{"x": .., "y": ..}]}, coordinates normalized to [0, 1] from the top-left corner.'
        )
        return _spatial_task("point", self.turn(ask), spatial.points("json", max_objects=max_objects))

    def generate(self, prompt: str, output_type: Any, parse: Callable[[str], Any]) -> Task:
        return Task("generate", self.turn(prompt), output_type, parse, _is_loc(output_type))

    def turn(self, text: str) -> str:
        """The prompt text of one user turn asking `text` (image placeholder first for vision families)."""
        if self.image_token:
            text = f"{self.image_token}\n{text}"
        if not self.has_template:
            return f"Question: {text}\nAnswer:"
        messages = [{"role": "user", "content": text}]
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._without_bos(prompt)

    def _without_bos(self, prompt: str) -> str:
        # The processor tokenizes with special tokens; a template that writes BOS would give two.
        bos = getattr(self.tokenizer, "bos_token", None)
        adds_bos = bos is not None and self.tokenizer("").get("input_ids", [])[:1] == [
            self.tokenizer.bos_token_id
        ]
        if adds_bos and prompt.startswith(bos):
            return prompt[len(bos) :]
        return prompt


def skills_for(folder: Path | None, family: str, tokenizer: Any, image_token: str | None) -> Skills:
    """The skills of a loaded model: shapes (folder has foveal.json), PaliGemma, or chat."""
    if folder is not None and (folder / FORMAT_FILE).is_file():
        fmt = ShapesFormat.load(folder)
        if fmt.family != family:
            raise ValueError(
                f"{folder / FORMAT_FILE} describes a {fmt.family!r} model but the checkpoint is {family!r}; "
                "remove foveal.json or export the folder again with python -m foveal.train_shapes --export"
            )
        return ShapesSkills(fmt)
    if family == "paligemma":
        return PaliGemmaSkills()
    return ChatSkills(tokenizer, image_token)


# ---- parsers ----------------------------------------------------------------------------------------------------


def _spatial_task(skill: str, prompt: str, spec: spatial.SpatialSpec) -> Task:
    key = "objects" if spec.kind == "boxes" else "points"
    return Task(skill, prompt, spec, lambda text: spatial.parse(spec, text)[key], spec.encoding == "loc")


def _is_loc(spec: Any) -> bool:
    return isinstance(spec, spatial.SpatialSpec) and spec.encoding == "loc"


def _box_centres(result: dict) -> list[dict[str, float]]:
    return [
        {"x": (b["x_min"] + b["x_max"]) / 2, "y": (b["y_min"] + b["y_max"]) / 2} for b in result["objects"]
    ]
