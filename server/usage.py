"""OpenAI's `usage` and `finish_reason` for a chat answer, and Moondream's `metrics` for its REST
answers, from the engine's own counts and clock.

A complete answer's result (or stream) carries `foveal.Usage`: the prompt's tokens as the engine ran
them (template and image tokens included), the tokens generated (a stop string's text cut off, as the
engine cut it), why generation ended, and the engine's timings of the request. A constrained answer
cut by max_tokens carries it on its IncompleteOutputError. The server counts and times nothing
itself: it has no tokenizer of its own, and its own clock would add the HTTP and queueing around
the call (its latency histogram, metrics.py, measures that).
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


def moondream_metrics(counted: Usage) -> dict[str, int | float]:
    """Moondream's API `metrics` object: tokens in and out, and the engine's milliseconds (prefill:
    admission to the first token; decode: first token to the end; ttft: submit to the first token)."""
    return {
        "input_tokens": counted.prompt_tokens,
        "output_tokens": counted.completion_tokens,
        "prefill_time_ms": round(counted.prefill_time_ms, 3),
        "decode_time_ms": round(counted.decode_time_ms, 3),
        "ttft_ms": round(counted.ttft_ms, 3),
    }
