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
    point with spatial refs: point.prefix + each ref's coord (and size) values + " " + object +
               point.suffix (Moondream's engine's layout, kestrel's point skill; the preview's HF
               code has no such call), decoded as point is.
    adapters   settings["adapter"]: a fine-tune of Moondream's API, `<finetune_id>@<step>` or a file
               (lora.py: its format is Moondream's engine's, LoRA on the dense MLPs and the experts),
               applied to the whole call as Moondream 2's variants are; Moondream 2's
               settings["variant"] is refused (the preview's own LoRA code, attention and dense
               MLPs only, has no published checkpoints in its format).
Quantized weights (int8 / int4 on CPU) load as for Moondream 2 (quantize.py, moe_quant.py).

    segment    segment.prefix + each ref's coord (and size) values + object (no leading space) +
               segment.suffix; the answer is coord, coord, size (region steps), then path tokens until
               eos (segment.py's `SegmentMatcher`); value {"path": normalized SVG path, "bbox"}.
               The template is the checkpoint's `segment` one; a config without one (the preview's
               HF config, the moondream3-tiny fixture) gets Moondream's documented ids [1, 17374, 2]
               / [3], mapped as the checkpoint maps its other templates (`segment_template`).
               Token boundaries: the path is read from its tokens one at a time (two integer tokens
               "12" "34" are two numbers), which the decoded text loses for a byte-level
               tokenizer; so `prepare` binds the call's parse and stream progress to its matcher's
               committed items, and its read to the output's token ids, never to the text.
               No refiner head is loaded (none is in the preview checkpoint): the path is the coarse one.
`region_values(text)` reads a committed answer's region steps back into the floats the region head
gave: coordinates bin / 1024 and sizes 2^(bin / 1023 * 10 - 10), in answer order.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from foveal.families.base import CallSettings
from foveal.families.moondream import lora
from foveal.families.moondream.family import (
    VALUE,
    MoondreamFamily,
    ref_parts,
)
from foveal.families.moondream.processor import MoondreamPrompt
from foveal.families.moondream.region import coord_from_bin, size_from_bins
from foveal.families.moondream.segment import PathTokens, SegmentMatcher, value_of_ids
from foveal.families.prepared import CallLimits, ImagesOf, Prepared
from foveal.families.task import Task

# The HF preview code's templates, and the segment template Moondream's engine uses (the fixture
# README); a tiny checkpoint may take ids >= 10 modulo its vocabulary (the fixture's rule).
REAL_TEMPLATES: dict[str, Any] = {
    "caption": {"short": [1, 32708, 2, 12492, 3], "normal": [1, 32708, 2, 6382, 3], "long": [1, 32708, 2, 4059, 3]},
    "query": {"prefix": [1, 15381, 2], "suffix": [3]},
    "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
    "point": {"prefix": [1, 2581, 2], "suffix": [3]},
}
SEGMENT_TEMPLATE = {"prefix": [1, 17374, 2], "suffix": [3]}


def _mapped(template: Any, vocab_size: int) -> Any:
    if isinstance(template, dict):
        return {k: _mapped(v, vocab_size) for k, v in template.items()}
    return [i if i < 10 else i % vocab_size for i in template]


def segment_template(templates: dict, vocab_size: int) -> dict | None:
    """The checkpoint's segment template; else the documented one, where every template the checkpoint
    has is the preview's with the same mapping of ids (identity for the real vocabulary, ids >= 10
    modulo the vocabulary for the tiny fixture); else None (an unknown template set)."""
    if templates.get("segment"):
        return templates["segment"]
    known = [k for k in templates if k in REAL_TEMPLATES]
    if known and all(
        _mapped(REAL_TEMPLATES[k], vocab_size) == _mapped(templates[k], 1 << 62) for k in known
    ):
        return _mapped(SEGMENT_TEMPLATE, vocab_size)
    return None


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


def _unbound(text: str) -> dict[str, Any]:
    raise RuntimeError("a Moondream 3 segment task is read through Moondream3Family.prepare (its token pieces)")


class Moondream3Family(MoondreamFamily):
    """A Moondream 3 checkpoint; constructed by MoondreamFamily.load, never matched on its own."""

    def __init__(self, loaded: Any, config: Any, folder: Any = None) -> None:
        super().__init__(loaded, config, folder)
        self._segment = segment_template(self.templates, config.text.vocab_size)
        segments = frozenset({"segment"}) if self._segment is not None else frozenset()
        self._path_tokens: PathTokens | None = None  # built on the first segment call
        self._path_lock = threading.Lock()
        caps = self.capabilities  # Moondream 2's, but segment where the template allows it, adapters, no variants
        refs = caps.spatial_refs | segments | {"point"}
        self.capabilities = dataclasses.replace(caps, skills=caps.skills | segments, spatial_refs=refs, variants=False)

    REFS_WITH_REASONING = "the preview's reference fails on it; ask with one or the other"

    def _query_suffix(self) -> tuple[int, ...]:
        """Moondream 3's query prompt ends with query.suffix once."""
        return tuple(self._template("query")["suffix"])

    def _thinking_suffix(self) -> tuple[int, ...]:
        """Moondream 3's reasoning phase: the thinking id straight after the question."""
        return (self.ids.thinking_id,)

    def with_settings(self, task: Task, settings: CallSettings) -> Task:
        """The task with the call's adapter (settings['adapter']) resolved and loaded, its index and
        identity on the prompt (the runner's rows, the prefix cache's salt); a variant is refused."""
        if settings.variant is not None:
            raise self.unsupported_option(
                "settings['variant'] (Moondream 2's LoRA variants)",
                "a Moondream 3 fine-tune is settings['adapter'] = '<finetune_id>@<step>' or its file's path",
            )
        if settings.adapter is None:
            return task
        index, identity = self.runner.variants.load(lora.resolve_adapter(settings.adapter, self.folder))
        p = task.prompt
        return dataclasses.replace(task, prompt=MoondreamPrompt(p.prefix, p.text, p.suffix, index, identity))

    def spatial_point(self, phrase: str, max_objects: int, refs: tuple[tuple[float, ...], ...]) -> Task:
        """point's task with the refs' values after point.prefix, before the object's ids."""
        task = self.point(phrase, max_objects)
        p = task.prompt
        return dataclasses.replace(task, prompt=MoondreamPrompt((*p.prefix, *ref_parts(refs)), p.text, p.suffix))

    def segment(self, phrase: str, refs: tuple[tuple[float, ...], ...] | None) -> Task:
        """segment.prefix + the refs' values + object (no leading space, as Moondream's engine) +
        segment.suffix; the answer under `SegmentMatcher`, read by `prepare`'s bindings."""
        if self._segment is None:
            raise self.unsupported("segment")
        tokens = self.path_tokens()
        if not tokens:
            raise self.unsupported_option(
                "segment with this tokenizer", "its vocabulary has no tokens that spell an SVG path (M, integers)"
            )
        prompt = MoondreamPrompt(
            (*self._segment["prefix"], *ref_parts(refs or ())),
            self.plain("object", phrase),
            tuple(self._segment["suffix"]),
        )
        return Task("segment", prompt, parse=_unbound, keep_special=True, rules=lambda: SegmentMatcher(tokens),
                    progress=_unbound)

    def path_tokens(self) -> PathTokens:
        """The vocabulary's path tokens (segment.py), decoded once, on the first segment call."""
        with self._path_lock:
            if self._path_tokens is None:
                self._path_tokens = PathTokens(self.tokenizer, self.config.text.vocab_size, self.ids.eos_id)
            return self._path_tokens

    def prepare(self, task: Task, images: ImagesOf, limits: CallLimits) -> Prepared:
        """A segment call's value is read from token pieces, not from the decoded text, which can lose
        token boundaries ("12" + "34" reads "1234" in a byte-level tokenizer's text): its parse and
        stream progress read its own matcher's committed items (the engine commits into that matcher
        before it releases the text of the same tokens), its read the output's token ids."""
        prepared = super().prepare(task, images, limits)
        if task.skill != "segment":
            return prepared
        matcher = prepared.request.matcher
        assert isinstance(matcher, SegmentMatcher)  # the task's rules
        bound = dataclasses.replace(
            prepared.task,
            parse=lambda text: matcher.value(final=True),
            progress=lambda text: matcher.value(final=False),
        )
        tokens = matcher.tokens
        return dataclasses.replace(prepared, task=bound, read=lambda output: value_of_ids(tokens, output.token_ids))

    def _gate_ids(self) -> tuple[int, ...]:
        return (self.ids.coord_id, self.ids.eos_id)
