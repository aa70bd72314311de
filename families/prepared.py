"""`Prepared`: one skill call made whole by its family, ready to submit; and what a call may spend.

PROBLEM
    Between a checked skill call and the engine request lie a family's decisions: which grammar the
    answer is decoded under (compiled once, or, for boxes and points, only after the prompt's length
    says how many items the token budget holds), which tokens free text must never hold, whether
    the answer's text keeps special tokens, which distributions the scores read, and how the text
    becomes the value. Spread over the SDK, they made it branch on the grammar's type and reach
    into the family's tokenizer.
SOLUTION
    `Family.prepare(task, images, limits)` makes every one of them in one pass and
    returns a `Prepared`: the engine `Request` (prompt ids, prefill inputs, sampling, matcher) and
    `read`, which turns the finished request's output into the value (parsed, and scored where the
    task scores its items). The SDK decodes the images when the family asks, hands over the `CallLimits` (the caller's
    sampling and token budget, the context's size), submits `prepared.request` and returns what
    `read` gives, wrapped in the skill's result type. It knows no spec type, no scorer, no tokenizer.
INVARIANTS (tests/sdk/test_prepared.py)
    - A bad output type raises before the images are encoded (`SchemaError`); a budget that cannot
      hold the answer's fixed start, or one box or point, raises ValueError before any submit.
    - A spatial answer's max_objects never exceeds what `max_tokens` holds: a complete answer fits.
    - `read` is pure: the same output reads to the same value, from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image

from foveal.engine.matcher import Matcher
from foveal.engine.request import Request, RequestOutput, SamplingParams
from foveal.families.scores import Decoded, Scorer, with_scores
from foveal.families.task import Task


class AnswerAutomaton(Protocol):
    """What a call's answer is decoded under: a compiled grammar (`foveal.grammars.Automaton`) or a
    family's own automaton (Moondream's region answers): one fresh matcher per call."""

    min_tokens: int  # tokens every answer takes at least (its forced start), for budget checks

    def matcher(self) -> Matcher: ...


@dataclass(frozen=True, slots=True)
class CallLimits:
    """What a call may spend: the caller's sampling (its max_tokens is the caller's or the skill's
    default), whether the caller chose max_tokens, the model's context, and the least score kept."""

    sampling: SamplingParams
    explicit: bool  # the caller set max_tokens: it is not shrunk to the room the prompt leaves
    max_model_len: int
    min_score: float = 0.0

    def budget(self, prompt_len: int) -> int:
        """max_tokens for a prompt of `prompt_len` tokens: a skill's default shrinks to the room the
        prompt leaves; an explicit one is the caller's. Whether it fits is checked once, by the
        engine's submit."""
        if self.explicit:
            return self.sampling.max_tokens
        return max(1, min(self.sampling.max_tokens, self.max_model_len - prompt_len))


# The call's images, decoded when the family asks for them (after its output spec compiled, so that a
# bad output type fails before any image is read), and their content key (None without images).
ImagesOf = Callable[[], tuple[list[Image.Image], str | None]]


@dataclass(frozen=True, slots=True)
class Prepared:
    """One call ready to submit: its task (as it applies to the call's images), its engine request,
    how its output reads, and the image the result is about."""

    task: Task
    request: Request
    read: Callable[[RequestOutput], Any]  # the finished output -> the value (parsed, items scored)
    image: Image.Image | None  # the call's (first) image

    @property
    def skill(self) -> str:
        return self.task.skill

    @property
    def constrained(self) -> bool:
        """Decoded under a grammar: an answer cut at max_tokens is incomplete, not short."""
        return self.task.spec is not None


def reader(
    task: Task, automaton: AnswerAutomaton | None, eos_token_ids: frozenset[int], min_score: float
) -> Callable[[RequestOutput], Any]:
    """The output -> the value: the task's parser (or the compiled spec's, or the text itself), and for
    a scored task its items with their scores, those below `min_score` left out."""
    # A compiled grammar (`grammars.Automaton`) carries its output's parser and the tokenizer handle
    # scorers read tokens with; a family's own automaton carries neither (its tasks bring their parser).
    parse: Callable[[str], Any] = task.parse if task.parse is not None else getattr(automaton, "parse", str)
    if task.score is None:
        return lambda output: parse(output.text)
    score: Scorer = task.score
    tokenizer = getattr(automaton, "tokenizer", None)

    def read(output: RequestOutput) -> Any:
        decoded = Decoded(output.token_ids, output.logprobs or [], tokenizer, eos_token_ids)
        return with_scores(parse(output.text), score(decoded), min_score)

    return read


def items_error(skill: str, max_tokens: int, one: int, prompt_len: int, max_model_len: int) -> ValueError:
    """Why not one box or point of `one` tokens fits: the caller's max_tokens, or the context."""
    room = max_model_len - prompt_len
    if one <= room:
        return ValueError(
            f"settings['max_tokens']={max_tokens} cannot hold one {skill} item (up to {one} tokens with "
            f"this object phrase); use max_tokens >= {one} or a shorter object phrase"
        )
    return ValueError(
        f"one {skill} item takes up to {one} tokens with this object phrase, but this model's context of "
        f"{max_model_len} leaves {room} after the prompt ({prompt_len} tokens); shorten the phrase"
    )


def fixed_start_error(min_tokens: int, max_tokens: int) -> ValueError:
    return ValueError(
        f"every answer of this output type starts with {min_tokens} tokens of fixed text, "
        f"more than the {max_tokens} it may have (settings['max_tokens'], at most what the context "
        "leaves after the prompt); raise max_tokens, shorten the fixed text, or put it in the prompt"
    )
