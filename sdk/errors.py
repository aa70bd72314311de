"""Errors a skill call can raise after its request was accepted (bad input raises before: see model.py).

Bad input is refused before any work with the exception that fits it: `TypeError` (wrong type),
`ValueError` (bad value, unknown or out-of-range setting, a prompt that does not fit),
`foveal.grammars.SchemaError` (an output type the grammar cannot enforce) and
`foveal.vision.ImageError` (unreadable image), the last two being ValueErrors too.
"""

from __future__ import annotations

from typing import Any


class GenerationError(RuntimeError):
    """The engine could not finish the request (cancelled, engine closed or failed), or its
    constrained answer did not parse (a bug: the message names the skill)."""


class ModelClosedError(GenerationError):
    """The model was closed: calls made after `close()`, and calls still running when it closed.

    Load the model again (`foveal.load(...)`) to keep working.
    """

    def __init__(self, skill: str) -> None:
        super().__init__(
            f"{skill}: cancelled, the model is closed; load it again with foveal.load(...) to call it"
        )


class IncompleteOutputError(RuntimeError):
    """A constrained answer reached `max_tokens` before its grammar was complete.

    The text so far is a valid prefix of the output shape but not a whole value; `text` holds it.
    """

    reply: Any  # set by model.chat only: the cut reply read back (foveal.tools.Reply)

    def __init__(
        self, skill: str, max_tokens: int, text: str, context_limited: bool = False, usage: Any = None
    ) -> None:
        fix = (
            "this is all the context leaves after the prompt: shorten the prompt or load with a larger "
            "max_model_len"
            if context_limited
            else "raise settings['max_tokens']"
        )
        super().__init__(
            f"{skill}: the answer reached max_tokens={max_tokens} before its output shape was complete; "
            f"{fix} (or lower settings['max_objects'] for detect/point)"
        )
        self.text = text
        self.usage = usage  # foveal.Usage of the cut answer (its tokens, finish_reason "length")
