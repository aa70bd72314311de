"""`Moondream3Family`: Moondream 3 (preview) as a Moondream family, where its prompts and decode rules differ from Moondream 2's.

Moondream 3 loads through `MoondreamFamily.load` (the generation is read from the checkpoint's
tensors, load.py) and shares Moondream 2's processor, runner, region steps, answers and parsers.
What the preview's code does differently, and this class states:
    query      query.prefix + question + query.suffix, the suffix once (Moondream 2 appends it twice);
    reasoning  query.prefix + question + the thinking id (no suffix before it); the answer after the
               reasoning is then query.suffix at the next position, as Moondream 2's;
    spatial refs on query: the same single suffix;
    detect / point: every gate after the first object decides on the lm_head rows [coord, eos] only
               (`_gate_ids`); the first gate, after the prompt, is the full argmax.
Not implemented for Moondream 3: LoRA variants (the preview applies them to attention and dense
MLPs only; a variant is refused by name) and quantized weights (refused at load, as for Moondream 2).

For segmentation (built elsewhere on this family), `region_values(text)` reads a committed answer's
region steps back into the floats the region head gave: coordinates bin / 1024 and sizes
2^(bin / 1023 * 10 - 10), in answer order, so a segment reader gets the centre and size of the object.
"""

from __future__ import annotations

from typing import Any

import torch

from foveal.families.base import CallSettings, Capabilities
from foveal.families.moondream.answers import ReasoningMatcher
from foveal.families.moondream.family import (
    REFERENCE_MAX_TOKENS,
    SKILLS,
    VALUE,
    MoondreamFamily,
    ref_parts,
)
from foveal.families.moondream.processor import MoondreamPrompt
from foveal.families.moondream.region import coord_from_bin, size_from_bins
from foveal.families.task import Task


def region_values(text: str) -> list[tuple[str, tuple[float, ...]]]:
    """The region values an answer's text spells (`<coord B>` / `<size W H>`), in order, as floats:
    ("coord", (x,)) or ("size", (w, h)), computed as the reference does."""
    out: list[tuple[str, tuple[float, ...]]] = []
    for kind, a, b in VALUE.findall(text):
        if kind == "coord":
            out.append(("coord", (coord_from_bin(torch.tensor(int(a))).item(),)))
        else:
            w, h = size_from_bins(torch.tensor([int(a), int(b)])).tolist()
            out.append(("size", (w, h)))
    return out


class Moondream3Family(MoondreamFamily):
    """A Moondream 3 checkpoint; constructed by MoondreamFamily.load, never matched on its own."""

    def __init__(self, loaded: Any, config: Any, folder: Any = None) -> None:
        super().__init__(loaded, config, folder)
        self.capabilities = Capabilities(
            SKILLS,
            vision=True,
            reasoning=True,
            gaze=True,
            spatial_refs=frozenset({"query"}),
            variants=False,
            token_budget=REFERENCE_MAX_TOKENS,
        )

    def _query_prompt(self, text: str) -> MoondreamPrompt:
        template = self._template("query")
        return MoondreamPrompt(tuple(template["prefix"]), text, tuple(template["suffix"]))

    def spatial_query(self, question: str, refs: tuple[tuple[float, ...], ...]) -> Task:
        """query.prefix + each ref's coord (and size) values + question + query.suffix (once)."""
        template = self._template("query")
        prompt = MoondreamPrompt(
            (*template["prefix"], *ref_parts(refs)), self.plain("question", question), tuple(template["suffix"])
        )
        return Task("query", prompt, rules=self._rules)

    def reasoning(self, question: str, refs: tuple[tuple[float, ...], ...] | None) -> Task:
        """query.prefix + question + the thinking id; eos and size masked after the first step."""
        if refs:
            raise self.unsupported_option(
                "spatial_refs together with reasoning=True",
                "the preview's reference fails on it; ask with one or the other",
            )
        template = self._template("query")
        prompt = MoondreamPrompt(tuple(template["prefix"]), self.plain("question", question), (self.ids.thinking_id,))
        masked = (self.ids.eos_id, self.ids.size_id)
        return Task("query", prompt, rules=lambda: ReasoningMatcher(self.ids.answer_id, masked))

    def _gate_ids(self) -> tuple[int, ...]:
        return (self.ids.coord_id, self.ids.eos_id)

    def with_settings(self, task: Task, settings: CallSettings) -> Task:
        if getattr(settings, "variant", None) is not None:
            raise self.unsupported_option("settings['variant']", "LoRA variants are not implemented for Moondream 3")
        return task
