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
The public results hold coordinates in [0, 1] (DESIGN.md), so a box that the reference lets run
past the image's edge is clipped to it; `parse_regions(..., clip=False)` gives the raw values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from foveal import grammars
from foveal.engine.models.arch import ModelLoadError
from foveal.engine.models.loader import LoadedModel, LoadOptions
from foveal.families.base import Capabilities, Family
from foveal.families.conversation import Conversation, single_user_message
from foveal.families.moondream.answers import AnswerMatcher, RegionMatcher
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.load import is_moondream, load_folder
from foveal.families.moondream.processor import MoondreamPrompt
from foveal.families.moondream.region import coord_from_bin, size_from_bins
from foveal.families.task import Task

VALUE = re.compile(r"<(coord|size) (\d+)(?: (\d+))?>")


@dataclass(frozen=True, slots=True)
class RegionAnswer:
    """A detect / point answer spec that is its own automaton (no grammar to compile)."""

    with_size: bool
    max_objects: int
    vocab_size: int
    eos_id: int
    is_automaton = True
    min_tokens = 1

    def matcher(self) -> RegionMatcher:
        return RegionMatcher(self.with_size, self.max_objects, self.vocab_size, self.eos_id)


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


SKILLS = frozenset({"caption", "query", "detect", "point", "generate", "chat"})


class MoondreamFamily(Family):
    name = "moondream"
    architectures = ("HfMoondream",)

    def __init__(self, loaded: LoadedModel, config: MoondreamConfig) -> None:
        super().__init__(loaded, Capabilities(SKILLS, vision=True))
        self.config = config
        self.ids = config.tokenizer
        self.templates = config.tokenizer.templates

    @classmethod
    def matches(cls, raw: dict, folder: Path) -> bool:
        return is_moondream(raw)

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> MoondreamFamily:
        for name, value in (("quantize", options.quantize), ("image_options", options.image_options)):
            if value:
                raise ModelLoadError(f"{name} is not supported for Moondream 2 (its own implementation); leave it unset")
        loaded, config = load_folder(folder, options.device, options.dtype, str(folder), options.image_cache_bytes)
        return cls(loaded, config)

    def compile(self, spec: Any) -> grammars.Automaton | None:
        if isinstance(spec, RegionAnswer):  # its own automaton: nothing to compile
            return spec
        return super().compile(spec)

    def encode(self, task: Any, images: list, image_key: str | None) -> tuple[Any, Any]:
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

    def _query_prompt(self, text: str) -> MoondreamPrompt:
        template = self._template("query")
        return MoondreamPrompt(tuple(template["prefix"]), text, tuple(template["suffix"]) * 2)

    def query(self, question: str) -> Task:
        return Task("query", self._query_prompt(self.plain("question", question)), rules=self._rules)

    def detect(self, phrase: str, max_objects: int) -> Task:
        return self._region_task("detect", phrase, max_objects, with_size=True)

    def point(self, phrase: str, max_objects: int) -> Task:
        return self._region_task("point", phrase, max_objects, with_size=False)

    def _region_task(self, skill: str, phrase: str, max_objects: int, with_size: bool) -> Task:
        template = self._template(skill)
        prompt = MoondreamPrompt(
            tuple(template["prefix"]), " " + self.plain("object", phrase), tuple(template["suffix"])
        )
        spec = RegionAnswer(with_size, max_objects, self.config.text.vocab_size, self.ids.eos_id)
        return Task(skill, prompt, spec, lambda text: parse_regions(text, with_size), keep_special=True)

    def generate(self, prompt: str, output_type: Any) -> Task:
        return self._ask("generate", self.plain("prompt", prompt), output_type)

    def chat(self, conversation: Conversation, output_type: Any) -> Task:
        text = single_user_message(conversation, "this moondream model").text  # asked as a query
        return self._ask("chat", self.plain("message", text), output_type)

    def _ask(self, skill: str, text: str, output_type: Any) -> Task:
        if output_type is None:
            return Task(skill, self._query_prompt(text), rules=self._rules)
        return Task(skill, self._query_prompt(text), output_type)
