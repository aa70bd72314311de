"""`Task`: one skill call made concrete by a family, and the spatial tasks every family builds the same way.

A task is what the SDK needs to run a call and read its answer: the skill's name (which result type
wraps the value), the prompt in the family's own form (a `Conversation` for families with a chat
template, a task-prefix string for PaliGemma, a `MoondreamPrompt`), the output spec the grammar
compiles, how the answer's text becomes the value, and how its items are scored. The SDK never looks
inside `prompt`: it hands it back to the family's `encode`.
Scores (`score`) are defined in families/scores.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from foveal.families.scores import Scorer, spatial_scores
from foveal.grammars import spatial


@dataclass(frozen=True, slots=True)
class Task:
    skill: str  # caption | query | detect | point | generate | chat | segment | gaze
    prompt: Any  # the family's prompt (see the module docstring)
    spec: Any = None  # an output spec for grammars.compile, or a family's own automaton; None: free text
    parse: Callable[[str], Any] | None = None  # the model's text -> the value; None: the compiled spec's own
    keep_special: bool = False  # the answer's text keeps special tokens (location tokens may be special)
    # Free text under the family's own decode rules: a factory of one call's matcher. None: unconstrained.
    rules: Callable[[], Any] | None = None
    # A score in [0, 1] per item of the value (boxes, points), in order; None: the value is not scored.
    score: Scorer | None = None
    # A streamed answer's text so far -> what of its value is settled, for skills whose stream is of
    # updates, not text (segment: {"bbox": the box or None while unknown, "path": the settled path});
    # None: the stream is the text itself.
    progress: Callable[[str], dict[str, Any]] | None = None


def spatial_task(skill: str, prompt: Any, spec: spatial.SpatialSpec) -> Task:
    """A detect / point task whose answer is `spec`, whose value is its boxes or points, each scored.
    (max_objects plays no part in a score: a task refitted to its token budget keeps its scorer.)"""
    key = "objects" if spec.kind == "boxes" else "points"
    parse = lambda text: spatial.parse(spec, text)[key]  # noqa: E731
    return Task(skill, prompt, spec, parse, is_loc(spec), score=lambda decoded: spatial_scores(spec, decoded))


def is_loc(spec: Any) -> bool:
    """Whether the answer is written in location tokens (special tokens the text must keep)."""
    return isinstance(spec, spatial.SpatialSpec) and spec.encoding == "loc"


def box_centres(result: dict) -> list[dict[str, float]]:
    return [
        {"x": (b["x_min"] + b["x_max"]) / 2, "y": (b["y_min"] + b["y_max"]) / 2} for b in result["objects"]
    ]
