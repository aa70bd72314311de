"""`MoondreamFamily`: Moondream 2 (foveal's own implementation), its skills in the model's own format.

Moondream's prompts are template ids from its config around the user's text (`MoondreamPrompt`):
    caption  the caption template of the length (short / normal / long);
    query    query.prefix + question + query.suffix + query.suffix (the reference appends the
             suffix twice when reasoning is off); without an image the same after BOS, causal;
    detect   detect.prefix + " " + object + detect.suffix (the object text gets a leading space);
    point    point.prefix + " " + object + point.suffix;
    generate the query layout, the answer constrained by the output type's grammar;
    chat     one user message, asked as a query (Moondream has no chat template).
Decode rules (the reference's): a caption / query answer may start with any token, later tokens
never with the answer id (`AnswerMatcher`, through `Task.rules`); detect / point answers are
region automata (`RegionMatcher`): stop-or-x, y, (size), ... decoded by the engine's region steps,
whose committed values the tokenizer spells `<coord B>` / `<size W H>` and `parse_regions` turns
back into the reference's floats: x = bin / 1024, size = 2^(bin / 1023 * 10 - 10) in float32,
box = (x - w/2, y - h/2, x + w/2, y + h/2) in Python floats.
Coordinates and sizes are always the region heads' argmax, as in the reference; settings' temperature
and seed apply to text tokens and to the stop-or-continue token of a region answer.
The public results hold coordinates in [0, 1] (docs/skills.md), so a box that the reference lets run
past the image's edge is clipped to it; `parse_regions(..., clip=False)` gives the raw values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from foveal.engine.models.arch import ModelLoadError
from foveal.engine.models.loader import LoadedModel, LoadOptions
from foveal.engine.models.processor import PromptInputs
from foveal.families.base import CallSettings, Capabilities, Family
from foveal.families.conversation import Conversation, single_user_message
from foveal.families.moondream import lora
from foveal.families.moondream.answers import AnswerMatcher, ReasoningMatcher, RegionMatcher
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.load import is_moondream, load_folder
from foveal.families.moondream.processor import Coord, MoondreamPrompt, Size
from foveal.families.moondream.region import coord_from_bin, size_from_bins, value_of
from foveal.families.moondream.scores import region_scores
from foveal.families.prepared import AnswerAutomaton
from foveal.families.task import Task

VALUE = re.compile(r"<(coord|size) (\d+)(?: (\d+))?>")


@dataclass(frozen=True, slots=True)
class RegionAnswer:
    """A detect / point answer spec that is its own automaton (no grammar to compile)."""

    with_size: bool
    max_objects: int
    vocab_size: int
    eos_id: int
    gate_ids: tuple[int, ...] = ()  # Moondream 3: later gates choose among these tokens only
    is_automaton = True
    min_tokens = 1

    def matcher(self) -> RegionMatcher:
        return RegionMatcher(self.with_size, self.max_objects, self.vocab_size, self.eos_id, self.gate_ids)


def parse_regions(text: str, with_size: bool, clip: bool = True) -> list[dict[str, float]]:
    """The objects of a region answer's text (complete objects only), as the reference computes them."""
    values = [(kind, int(a), int(b) if b else None) for kind, a, b in VALUE.findall(text)]
    step = 3 if with_size else 2
    out = []
    for i in range(0, len(values) - step + 1, step):
        (_, x_bin, _), (_, y_bin, _) = values[i], values[i + 1]
        x = coord_from_bin(torch.tensor(x_bin)).item()
        y = coord_from_bin(torch.tensor(y_bin)).item()
        if not with_size:
            out.append({"x": x, "y": y})
            continue
        _, w_bin, h_bin = values[i + 2]
        w, h = (v.item() for v in size_from_bins(torch.tensor([w_bin, h_bin])))
        out.append({"x_min": x - w / 2, "y_min": y - h / 2, "x_max": x + w / 2, "y_max": y + h / 2})
    if clip:
        out = [{k: min(1.0, max(0.0, v)) for k, v in item.items()} for item in out]
    return out


def parse_gaze(text: str) -> dict[str, float] | None:
    """The gaze point of a gaze answer's text (one point, or None where the model said eos)."""
    points = parse_regions(text, with_size=False)
    return points[0] if points else None


SKILLS = frozenset({"caption", "query", "detect", "point", "generate", "chat"})
REFERENCE_MAX_TOKENS = 768  # the reference's default max_tokens of captions and answers
GAZE_PROMPT = ("\n\nPoint:", " gaze\n\n")  # the reference's strings around the eye's coordinates


def bf16(value: float) -> float:
    """A float rounded to bfloat16, as the reference builds detect_gaze's eye tensor."""
    return torch.tensor(value, dtype=torch.float32).to(torch.bfloat16).float().item()


def ref_parts(refs: tuple[tuple[float, ...], ...]) -> tuple[Coord | Size, ...]:
    """Spatial references as the reference encodes them: a point (x, y) -> coord x, coord y; a box
    (x1, y1, x2, y2) -> coord of its centre's x, y, then size (x2 - x1, y2 - y1); in order."""
    parts: list[Coord | Size] = []
    for ref in refs:
        if len(ref) == 2:
            parts += [Coord(ref[0]), Coord(ref[1])]
        else:
            x1, y1, x2, y2 = ref
            parts += [Coord((x1 + x2) / 2), Coord((y1 + y2) / 2), Size(x2 - x1, y2 - y1)]
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A grounded reasoning's text and groundings, read from its committed ids as the reference does."""

    text: str
    grounding: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "grounding": self.grounding}


def parse_reasoning(ids: list[int], decode: Any, tokens: Any, vocab_size: int) -> tuple[Reasoning, list]:
    """(the reasoning, the prompt parts it fed) from a reasoning's committed ids (coordinates are value
    ids, region.py). Chunks open at start-ground / end-ground tokens; text = the chunks' decoded texts
    joined; a chunk with >= 2 coordinates is a grounding over its own text, points = (x, y) pairs."""
    chunks: list[list[int]] = [[]]
    coords: list[list[float]] = [[]]
    fed: list[int | Coord] = []
    for value_id in ids:
        kind, bins = value_of(vocab_size, value_id)
        token = tokens.coord_id if kind == "coord" else value_id
        if token in (tokens.start_ground_points_id, tokens.end_ground_id):
            chunks.append([])
            coords.append([])
        chunks[-1].append(token)
        if kind == "coord":
            x = coord_from_bin(torch.tensor(bins[0])).item()
            coords[-1].append(x)
            fed.append(Coord(x))
        else:
            fed.append(token)
    text, grounding = "", []
    for chunk, values in zip(chunks, coords, strict=True):
        piece = decode(chunk, skip_special_tokens=True) if chunk else ""
        if len(values) >= 2:
            points = [[values[i], values[i + 1]] for i in range(0, len(values) - 1, 2)]
            grounding.append({"start_idx": len(text), "end_idx": len(text) + len(piece), "points": points})
        text += piece
    return Reasoning(text, grounding), fed



class MoondreamFamily(Family):
    name = "moondream"
    architectures = ("HfMoondream",)
    checks_revision = True  # revisions.py tells a folder's revision from its cache refs or config.py

    def __init__(self, loaded: LoadedModel, config: MoondreamConfig, folder: Path | None = None) -> None:
        capabilities = Capabilities(
            SKILLS,
            vision=True,
            reasoning=True,
            gaze=True,
            spatial_refs=frozenset({"query"}),
            variants=True,
            token_budget=REFERENCE_MAX_TOKENS,
        )
        super().__init__(loaded, capabilities)
        self.config = config
        self.ids = config.tokenizer
        self.templates = config.tokenizer.templates
        self.folder = folder

    @classmethod
    def matches(cls, raw: dict, folder: Path) -> bool:
        return is_moondream(raw)

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> MoondreamFamily:
        if options.image_options:
            raise ModelLoadError("image_options is not supported for Moondream 2 or 3 (its own implementation); leave it unset")
        loaded, config = load_folder(
            folder, options.device, options.dtype, str(folder), options.image_cache_bytes, options.revision,
            options.quantize,  # "int8" / "int4" (quantize.py); "fp16" refused there
        )
        if config.generation == 3:
            from foveal.families.moondream.family3 import Moondream3Family  # it builds on this module

            return Moondream3Family(loaded, config, folder)
        return cls(loaded, config, folder)

    def compile(self, spec: Any) -> AnswerAutomaton | None:
        if isinstance(spec, RegionAnswer):  # its own automaton: nothing to compile
            return spec
        return super().compile(spec)

    def encode(self, task: Task, images: list[Image.Image], image_key: str | None) -> tuple[PromptInputs, Task]:
        """Moondream's processor takes one image (or none): capabilities.max_images is 1."""
        return self.processor(task.prompt, images[0] if images else None, image_key=image_key), task


    def _template(self, skill: str) -> dict:
        template = self.templates.get(skill)
        if not template:
            raise ValueError(
                f"this Moondream checkpoint has no {skill} template; it does not support {skill}"
            )
        return template

    def _rules(self) -> AnswerMatcher:
        return AnswerMatcher(self.ids.answer_id)

    def caption(self, length: str) -> Task:
        template = self._template("caption")
        if length not in template:
            raise ValueError(
                f"this Moondream checkpoint has no {length!r} caption; use one of {', '.join(template)}"
            )
        return Task("caption", MoondreamPrompt(tuple(template[length])), rules=self._rules)

    # the reason a query with spatial_refs and reasoning=True is refused
    REFS_WITH_REASONING = "the reference fails on it at this revision; ask with one or the other"

    def _query_suffix(self) -> tuple[int, ...]:
        """What a query's prompt ends with: Moondream 2's template feeds query.suffix twice."""
        return tuple(self._template("query")["suffix"]) * 2

    def _thinking_suffix(self) -> tuple[int, ...]:
        """What a reasoning phase's prompt ends with: query.suffix, then the thinking id."""
        return (*self._template("query")["suffix"], self.ids.thinking_id)

    def _query_prompt(self, text: str) -> MoondreamPrompt:
        return MoondreamPrompt(tuple(self._template("query")["prefix"]), text, self._query_suffix())

    def query(self, question: str) -> Task:
        return Task("query", self._query_prompt(self.plain("question", question)), rules=self._rules)

    def spatial_query(self, question: str, refs: tuple[tuple[float, ...], ...]) -> Task:
        """query.prefix + each ref's coord (and size) values + question + the query's suffix."""
        template = self._template("query")
        prompt = MoondreamPrompt(
            (*template["prefix"], *ref_parts(refs)), self.plain("question", question), self._query_suffix()
        )
        return Task("query", prompt, rules=self._rules)

    def reasoning(self, question: str, refs: tuple[tuple[float, ...], ...] | None) -> Task:
        """The reasoning phase of query(reasoning=True): query.prefix + question + the thinking suffix;
        its answer's ids are read by `reasoned_answer`."""
        if refs:
            raise self.unsupported_option("spatial_refs together with reasoning=True", self.REFS_WITH_REASONING)
        template = self._template("query")
        prompt = MoondreamPrompt(tuple(template["prefix"]), self.plain("question", question), self._thinking_suffix())
        masked = (self.ids.eos_id, self.ids.size_id)
        return Task("query", prompt, rules=lambda: ReasoningMatcher(self.ids.answer_id, masked))

    def reasoned_answer(self, task: Task, token_ids: list[int]) -> tuple[dict[str, Any], Task]:
        """The reasoning read from its ids, and the answer's task: the reasoning's prompt, every token
        it fed (coordinates as their values), then query.suffix (the answer id) at the next position."""
        if token_ids and token_ids[-1] == self.ids.answer_id:
            token_ids = token_ids[:-1]  # the id that ended the reasoning; the suffix feeds it again
        thought, fed = parse_reasoning(token_ids, self.tokenizer.decode, self.ids, self.config.text.vocab_size)
        base = task.prompt
        suffix = (*base.suffix, *fed, *self._template("query")["suffix"])
        prompt = MoondreamPrompt(base.prefix, base.text, suffix, base.variant, base.variant_name)
        return thought.as_dict(), Task("query", prompt, rules=self._rules)

    def detect_gaze(self, eye: tuple[float, float]) -> Task:
        """The reference's gaze prompt: "\n\nPoint:", the eye's x and y (rounded to bfloat16 as the
        reference's tensor is), " gaze\n\n"; then one point, or eos for none."""
        before, after = GAZE_PROMPT
        prompt = MoondreamPrompt((before, Coord(bf16(eye[0])), Coord(bf16(eye[1])), after))
        spec = RegionAnswer(False, 1, self.config.text.vocab_size, self.ids.eos_id)
        return Task("gaze", prompt, spec, parse_gaze, keep_special=True)

    def with_settings(self, task: Task, settings: CallSettings) -> Task:
        """The task with the call's LoRA variant (settings['variant']) resolved and loaded; refused, as
        by every family, where the checkpoint declares no variants."""
        if not self.capabilities.variants:
            return super().with_settings(task, settings)
        if settings.adapter is not None:  # Moondream 3's format (lora.py); Moondream 2's fine-tunes are variants
            raise self.unsupported_option("settings['adapter'] (Moondream 3's fine-tunes)", "use settings['variant']")
        name = settings.variant
        if name is None:
            return task
        path = lora.resolve(name, self.folder)
        index, identity = self.runner.variants.load(path)
        p = task.prompt
        return replace(task, prompt=MoondreamPrompt(p.prefix, p.text, p.suffix, index, identity))

    def detect(self, phrase: str, max_objects: int) -> Task:
        return self._region_task("detect", phrase, max_objects, with_size=True)

    def point(self, phrase: str, max_objects: int) -> Task:
        return self._region_task("point", phrase, max_objects, with_size=False)

    def _gate_ids(self) -> tuple[int, ...]:
        """The tokens a region answer's later gates choose among; () for the whole vocabulary (Moondream 2)."""
        return ()

    def _region_task(self, skill: str, phrase: str, max_objects: int, with_size: bool) -> Task:
        template = self._template(skill)
        prompt = MoondreamPrompt(
            tuple(template["prefix"]), " " + self.plain("object", phrase), tuple(template["suffix"])
        )
        vocab, eos = self.config.text.vocab_size, self.ids.eos_id
        spec = RegionAnswer(with_size, max_objects, vocab, eos, self._gate_ids())
        return Task(
            skill, prompt, spec, lambda text: parse_regions(text, with_size), keep_special=True,
            score=lambda decoded: region_scores(decoded, with_size, vocab, eos),  # the heads' distributions
        )

    def generate(self, prompt: str, output_type: Any) -> Task:
        return self._ask("generate", self.plain("prompt", prompt), output_type)

    def chat(self, conversation: Conversation, output_type: Any) -> Task:
        text = single_user_message(conversation, "this moondream model").text  # asked as a query
        return self._ask("chat", self.plain("message", text), output_type)

    def _ask(self, skill: str, text: str, output_type: Any) -> Task:
        if output_type is None:
            return Task(skill, self._query_prompt(text), rules=self._rules)
        return Task(skill, self._query_prompt(text), output_type)
