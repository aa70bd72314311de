"""OpenAI's `usage` and `finish_reason` for a chat answer, from the engine's own counts.

A complete answer's result (or stream) carries `foveal.Usage`: the prompt's tokens as the engine
ran them (template and image tokens included), the tokens generated, and why generation ended. A
constrained answer cut by max_tokens carries it on its IncompleteOutputError. Only an answer the
server itself cut at a client's `stop` string (the request is cancelled there, so the engine
reports no count) is estimated: its text re-tokenized, the prompt side as the engine's prompt for
the same call would be unknown, so the text the client sent plus the image's tokens. The counter
owns a private copy of the tokenizer: the Model's is used under the Model's lock by its threads,
and a fast tokenizer must not be shared mid-call.
"""

from __future__ import annotations

import copy
from typing import Any

from foveal.results import Usage


class TokenCounter:
    def __init__(self, tokenizer: Any, image_tokens: int) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.image_tokens = image_tokens

    @classmethod
    def of_model(cls, model: Any) -> TokenCounter:
        hf_processor = getattr(model.family.processor, "hf_processor", None)
        image_tokens = int(getattr(hf_processor, "image_seq_length", 0) or 0)  # PaliGemma-style processors
        return cls(model.family.tokenizer, image_tokens)

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def usage(self, counted: Usage | None, prompt: str, has_image: bool, answer: str) -> dict[str, int]:
        """The engine's counts when it has them (`counted`), else the estimate of the module docstring."""
        if counted is not None:
            prompt_tokens, completion_tokens = counted.prompt_tokens, counted.completion_tokens
        else:
            prompt_tokens = self.count(prompt) + (self.image_tokens if has_image else 0)
            completion_tokens = self.count(answer)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }


def finish_reason(counted: Usage | None) -> str:
    """ "stop" for a natural end or a client's stop string (no `counted` then), "length" where
    max_tokens ended it."""
    return "length" if counted is not None and counted.finish_reason == "length" else "stop"
