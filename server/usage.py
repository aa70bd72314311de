"""OpenAI's `usage` and `finish_reason` for a chat answer, from the engine's own counts.

A complete answer's result (or stream) carries `foveal.Usage`: the prompt's tokens as the engine ran
them (template and image tokens included), the tokens generated (a stop string's text cut off, as the
engine cut it), and why generation ended. A constrained answer cut by max_tokens carries it on its
IncompleteOutputError. The server counts nothing itself: it has no tokenizer of its own.
"""

from __future__ import annotations

from foveal.results import Usage


def usage(counted: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": counted.prompt_tokens,
        "completion_tokens": counted.completion_tokens,
        "total_tokens": counted.prompt_tokens + counted.completion_tokens,
    }


def finish_reason(counted: Usage) -> str:
    """ "stop" for a natural end, the grammar's end or a stop string; "length" where max_tokens ended it."""
    return "length" if counted.finish_reason == "length" else "stop"
