"""The SDK's side of a skill call: argument checks, messages, result types and the guard of an answer's reading.

A skill call means the same thing on every model; the loaded model's family (`foveal.families`) turns
it into a `Task` (prompt, output spec, parser). What is the same for every family lives here:
- argument checks that raise before any work (`check_length`, `check_text`, `check_object`);
- `conversation(messages)`: OpenAI-style messages -> a `Conversation` and the images it holds;
- `RESULTS`: the result type of each skill;
- `read_value` and `guarded(skill, parse)`: a reading of an answer whose failures are GenerationErrors naming the
  skill (a constrained answer that does not parse is a bug to report, never a bare parser exception).
Nothing here names a model family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from foveal.errors import GenerationError
from foveal.families.conversation import ROLES, Conversation, Message
from foveal.results import (
    CaptionResult,
    ChatResult,
    DetectResult,
    GazeResult,
    GenerateResult,
    PointResult,
    QueryResult,
    Result,
    SegmentResult,
)

CAPTION_LENGTHS = ("short", "normal", "long")
MAX_PHRASE_CHARS = 200
RESULTS: dict[str, type[Result]] = {
    r.SKILL: r
    for r in (
        CaptionResult, QueryResult, DetectResult, PointResult, GenerateResult, ChatResult, GazeResult, SegmentResult
    )
}
_EXAMPLES = {"object": "red circle", "question": "how many shapes are there?", "prompt": "describe the image"}


def check_length(length: Any) -> str:
    if length not in CAPTION_LENGTHS:
        raise ValueError(f"length={length!r} is not accepted; use one of {', '.join(CAPTION_LENGTHS)}")
    return length


def check_text(name: str, value: Any, max_chars: int | None = None, one_line: bool = False) -> str:
    """A non-empty string argument (object phrase, question, prompt); `one_line` for object phrases."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} is empty; pass some text, e.g. {_EXAMPLES.get(name, 'a word')!r}")
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"{name} has {len(value)} characters; keep it under {max_chars}")
    if one_line and any(c in value for c in "\n\r\t"):
        raise ValueError(f"{name} must be one line (no newline or tab): {value!r}")
    return value


def check_object(value: Any) -> str:
    return check_text("object", value, MAX_PHRASE_CHARS, one_line=True).strip()


def _unit(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} = {value!r} is not accepted; coordinates are numbers in [0, 1] (normalized)")
    return float(value)


def check_spatial_refs(refs: Any) -> tuple[tuple[float, ...], ...] | None:
    """spatial_refs: None, or a non-empty list of points [x, y] and boxes [x1, y1, x2, y2] (normalized,
    x1 <= x2, y1 <= y2), as the reference client API takes them."""
    if refs is None:
        return None
    if isinstance(refs, str | bytes) or not isinstance(refs, Sequence) or not refs:
        raise TypeError("spatial_refs must be a non-empty list of [x, y] points or [x1, y1, x2, y2] boxes, or None")
    out = []
    for i, ref in enumerate(refs):
        if isinstance(ref, str | bytes) or not isinstance(ref, Sequence) or len(ref) not in (2, 4):
            raise ValueError(f"spatial_refs[{i}] = {ref!r:.80} is neither a point [x, y] nor a box [x1, y1, x2, y2]")
        values = tuple(_unit(f"spatial_refs[{i}][{j}]", v) for j, v in enumerate(ref))
        if len(values) == 4 and (values[0] > values[2] or values[1] > values[3]):
            raise ValueError(f"spatial_refs[{i}] = {list(values)} is a box with x1 > x2 or y1 > y2; give [x1, y1, x2, y2]")
        out.append(values)
    return tuple(out)


def check_eye(eye: Any) -> tuple[float, float]:
    """detect_gaze's eye: (x, y), normalized."""
    if isinstance(eye, str | bytes) or not isinstance(eye, Sequence) or len(eye) != 2:
        raise TypeError(f"eye must be the eye's (x, y), normalized to [0, 1]; got {eye!r:.80}")
    return _unit("eye[0]", eye[0]), _unit("eye[1]", eye[1])


def conversation(messages: Any) -> tuple[Conversation, list[Any]]:
    """OpenAI-style messages -> (a Conversation whose image parts index the returned images, the images).

    A message is `{"role": "system" | "user" | "assistant" | "tool", "content": str | [part, ...]}`,
    a part `{"type": "text", "text": str}` or `{"type": "image", "image": PIL | path | bytes | array}`.
    Images may be in any user message; the conversation must end with a user (or tool) message.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise TypeError('messages must be a non-empty list such as [{"role": "user", "content": "hello"}]')
    images: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {role!r}; use one of {', '.join(ROLES)}")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise ValueError(f"messages[{i}] has keys {unknown} that chat does not take; use 'role' and 'content'")
        parts = _parts(message.get("content"), f"messages[{i}]['content']", role, images)
        out.append(Message(role, tuple(parts)))
    if out[-1].role not in ("user", "tool"):
        raise ValueError(
            f"the last message is the {out[-1].role}'s; end the conversation with a user message to answer"
        )
    if not any(part for m in out for part in m.parts if isinstance(part, str) and part.strip()) and not images:
        raise ValueError("the messages hold no text and no image; say something")
    return tuple(out), images


def _parts(content: Any, where: str, role: str, images: list[Any]) -> list[str | int]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise TypeError(f"{where} must be a string or a list of parts, got {type(content).__name__}")
    parts: list[str | int] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "image" and part.get("image") is not None:
            if role != "user":
                raise ValueError(f"{where}[{j}]: images go in user messages, not in the {role}'s")
            parts.append(len(images))
            images.append(part["image"])
        else:
            raise ValueError(
                f'{where}[{j}] must be {{"type": "text", "text": str}} or {{"type": "image", "image": ...}}, '
                f"got {part!r:.100}"
            )
    return parts


def read_value(skill: str, read: Callable[[Any], Any], output: Any) -> Any:
    """`read(output)` (a `Prepared.read`), raising GenerationError naming the skill instead of the
    reader's own exception."""
    return guarded(skill, lambda _text: read(output))(output.text)


def guarded(skill: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, raising GenerationError naming the skill instead of the parser's own exception."""

    def guarded_parse(text: str) -> Any:
        try:
            return parse(text)
        except Exception as error:
            raise GenerationError(
                f"{skill}: the constrained answer {text[:200]!r} does not parse into the result "
                f"({type(error).__name__}: {error}); the grammar and the parser disagree, please report it"
            ) from error

    return guarded_parse
