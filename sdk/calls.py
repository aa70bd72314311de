"""Step 1 of every skill call: its arguments and settings checked, the family's task made, no image read.

Each skill has one builder here, with the skill's public signature (less `self`): `Model.detect` and
`Model.adetect` are one line each, `self._call(calls.detect(self.family, ...))` and its awaited twin,
and `SKILLS` is the table that `Model.map` and the signature test (tests/sdk/test_calls.py) read. A
builder returns a `Call`: what the one call path of `Model` (sync, async, streamed, over a list of
images) needs to run it, and nothing that depends on the images.
Nothing here names a model family: the family is asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from foveal import tools as chat_tools
from foveal.families import Family
from foveal.families.task import Task
from foveal.results import Usage
from foveal.settings import Settings, validate_settings
from foveal.skills import (
    check_eye,
    check_length,
    check_object,
    check_spatial_refs,
    check_text,
    conversation,
)

SETTINGS_OF = {"chat": "generate", "gaze": "point"}  # whose settings a skill takes (validate_settings)


@dataclass(frozen=True, slots=True)
class Call:
    """One checked skill call, before any image is read."""

    task: Task
    settings: Settings
    explicit: bool  # the caller chose max_tokens (a skill's default shrinks to the room the prompt leaves)
    images: list  # the call's images as given (each its own call where `each`)
    each: bool = False  # a list of images: the task on each of them
    stream: bool = False
    progress: bool | None = None  # `each`: tqdm's bar (None: only on a terminal)
    plan: chat_tools.ChatPlan | None = None  # chat: how its reply reads back (tools, thinking)
    logprobs: int | None = None  # chat: alternatives recorded per token
    reasoning: bool = False  # a grounded query's reasoning phase: its answer is a second call
    reasoned: dict | None = None  # that answer's call: the reasoning it carries into the result
    spent: Usage | None = None  # that answer's call: what the reasoning cost (the result's usage adds it)

    def answering(self, task: Task, reasoning: dict, spent: Usage | None = None) -> Call:
        """The answer phase of a grounded query: `task` (whose prompt holds the reasoning's ids)."""
        return dataclasses.replace(self, task=task, reasoning=False, reasoned=reasoning, spent=spent)


def caption(
    family: Family, image: Any, length: str = "normal", stream: bool = False, settings: Mapping | None = None
) -> Call:
    check_length(length)
    return _call(family, "caption", settings, lambda _: family.caption(length), image, stream)


def query(
    family: Family,
    image: Any = None,
    question: str | None = None,
    reasoning: bool = False,
    spatial_refs: Any = None,
    stream: bool = False,
    settings: Mapping | None = None,
) -> Call:
    check_flag("reasoning", reasoning, "query's third argument (the reference's order)")
    check_flag("stream", stream, "query's fifth argument")
    if reasoning and isinstance(image, list | tuple):
        raise ValueError("reasoning=True takes one image, not a list")
    text = check_text("question", question).strip()
    refs = check_spatial_refs(spatial_refs)
    if reasoning:
        if not family.capabilities.reasoning:
            raise family.unsupported("reasoning")
        make: Callable[[Settings], Task] = lambda _: family.reasoning(text, refs)  # noqa: E731
    elif refs is None:
        make = lambda _: family.query(text)  # noqa: E731
    else:
        make = lambda _: family.spatial_query(text, refs)  # noqa: E731
    call = _call(family, "query", settings, make, image, stream)
    return dataclasses.replace(call, reasoning=reasoning)


def detect_gaze(
    family: Family, image: Any, eye: Any = None, face: Any = None, unstable_settings: Mapping | None = None
) -> Call:
    if not family.capabilities.gaze:
        raise family.unsupported("detect_gaze")
    if eye is None:
        raise ValueError(
            "detect_gaze needs eye=(x, y), normalized; locating the face (face=) is not implemented"
        )
    if face is not None or unstable_settings:
        raise ValueError(
            "detect_gaze takes eye=(x, y) only: face= and unstable_settings (prioritize_accuracy, "
            "force_detect) are not implemented; remove them"
        )
    point = check_eye(eye)
    return _call(family, "gaze", None, lambda _: family.detect_gaze(point), image, False)


def detect(family: Family, image: Any, object: str, settings: Mapping | None = None) -> Call:
    phrase = check_object(object)
    return _call(family, "detect", settings, lambda s: family.detect(phrase, s.max_objects), image, False)


def point(
    family: Family, image: Any, object: str, settings: Mapping | None = None, spatial_refs: Any = None
) -> Call:
    phrase = check_object(object)
    refs = check_spatial_refs(spatial_refs)
    if refs is None:
        make: Callable[[Settings], Task] = lambda s: family.point(phrase, s.max_objects)  # noqa: E731
    elif "point" in family.capabilities.spatial_refs:
        make = lambda s: family.spatial_point(phrase, s.max_objects, refs)  # noqa: E731
    else:  # refused before the settings are read: the option itself is missing
        raise family.unsupported_option("spatial_refs on point", family.refs_hint())
    return _call(family, "point", settings, make, image, False)


def segment(
    family: Family,
    image: Any,
    object: str,
    spatial_refs: Any = None,
    stream: bool = False,
    settings: Mapping | None = None,
) -> Call:
    """The object's outline as an SVG path and its box, the reference client API's arguments in
    its order; spatial_refs (points and boxes) say which object is meant."""
    phrase = check_object(object)
    check_flag("stream", stream, "segment's fourth argument (the reference's order)")
    refs = check_spatial_refs(spatial_refs)
    if "segment" not in family.capabilities.skills:  # before its options: the skill itself is missing
        raise family.unsupported("segment")
    if refs is not None and "segment" not in family.capabilities.spatial_refs:
        raise family.unsupported_option("spatial_refs on segment", family.refs_hint())
    return _call(family, "segment", settings, lambda _: family.segment(phrase, refs), image, stream)


def generate(
    family: Family, image: Any, prompt: str, output_type: Any = None, settings: Mapping | None = None
) -> Call:
    check_text("prompt", prompt)
    return _call(family, "generate", settings, lambda _: family.generate(prompt, output_type), image, False)


def chat(
    family: Family,
    messages: Any,
    output_type: Any = None,
    settings: Mapping | None = None,
    stream: bool = False,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    logprobs: int | None = None,
) -> Call:
    """The chat call: its conversation and images, and its `foveal.tools.ChatPlan` (the grammar of
    its reply: tools, the thinking section)."""
    plain, fields = chat_tools.split_tool_fields(messages)
    talk, images = conversation(plain)
    plan = chat_tools.plan(
        output_type, tools, tool_choice, parallel_tool_calls, family.tool_format, family.thinking
    )
    if (plan.tools or any(calls for calls, _ in fields)) and not family.capabilities.conversations:
        raise ValueError(
            f"this {family.name} model has no chat template, so it cannot be given tools or tool "
            "messages; use a checkpoint whose tokenizer has a chat_template"
        )
    talk = chat_tools.attach_tool_fields(talk, fields, plan)
    for where, text in chat_tools.plain_texts(plan, talk):
        family.plain(where, text)
    task, s, explicit = skill_task(family, "chat", settings, lambda _: family.chat(talk, plan.spec))
    return Call(task, s, explicit, images, stream=stream, plan=plan, logprobs=logprobs)


# The skills, each by the builder of its calls (`Model.<skill>` and `Model.a<skill>` take its arguments).
SKILLS: dict[str, Callable[..., Call]] = {
    "caption": caption,
    "query": query,
    "detect": detect,
    "point": point,
    "generate": generate,
    "detect_gaze": detect_gaze,
    "chat": chat,
    "segment": segment,
}
MAPPED = ("caption", "query", "detect", "point", "generate")  # the skills `map` runs over images


def skill_task(
    family: Family, skill: str, settings: Mapping | None, make: Callable[[Settings], Task]
) -> tuple[Task, Settings, bool]:
    """The family's task for a call (`make(validated settings)`), after the settings and the family's
    declared skills are checked; with the settings and whether the caller chose max_tokens."""
    s, explicit = validated(settings, SETTINGS_OF.get(skill, skill))
    caps = family.capabilities
    if skill not in caps.skills and skill != "gaze":
        raise family.unsupported(skill)
    if not explicit and caps.token_budget is not None and skill in ("caption", "query"):
        s = dataclasses.replace(s, max_tokens=caps.token_budget)  # the family's own default
    task = family.with_settings(make(s), s)
    if s.stop and task.spec is not None:
        raise ValueError(
            f"settings['stop'] applies to free text; this {skill} answer is decoded under its output "
            "grammar, which decides where it ends: remove stop"
        )
    return task, s, explicit


def validated(settings: Mapping | Settings | None, skill: str) -> tuple[Settings, bool]:
    """Validated settings, and whether the caller chose max_tokens (defaults shrink to fit the context)."""
    explicit = isinstance(settings, Settings) or (isinstance(settings, Mapping) and "max_tokens" in settings)
    return validate_settings(settings, skill), explicit


def check_flag(name: str, value: Any, where: str) -> None:
    """A flag passed positionally where a settings dict was meant is refused, saying where it went."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {value!r}: {name} is {where}; pass settings=... by keyword"
        )


def _call(
    family: Family,
    skill: str,
    settings: Mapping | None,
    make: Callable[[Settings], Task],
    image: Any,
    stream: bool,
) -> Call:
    """A call on one image (or none), or on each image of a list."""
    task, s, explicit = skill_task(family, skill, settings, make)
    if isinstance(image, list | tuple):
        if stream:
            raise ValueError("stream=True takes one image, not a list")
        return Call(task, s, explicit, list(image), each=True)
    return Call(task, s, explicit, [] if image is None else [image], stream=stream)
