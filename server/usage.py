"""Token counts for OpenAI's `usage`, from the model's tokenizer (an adapter: the SDK's results do not
carry their token counts yet).

`completion_tokens` re-tokenizes the answer text, which gives the generated count whenever the
model's tokens were the canonical tokenization of their text (greedy decoding nearly always is);
`prompt_tokens` counts the text the client sent plus the image's tokens as the model's processor
would add them, without the skill's prompt template: an estimate, documented as such in the README.
The counter owns a private copy of the tokenizer: the Model's is used under the Model's lock by
its own threads, and a fast tokenizer must not be shared mid-call.
"""

from __future__ import annotations

import copy
from typing import Any


class TokenCounter:
    def __init__(self, tokenizer: Any, image_tokens: int) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.image_tokens = image_tokens

    @classmethod
    def of_model(cls, model: Any) -> TokenCounter:
        hf_processor = getattr(model.loaded.processor, "hf_processor", None)
        image_tokens = int(getattr(hf_processor, "image_seq_length", 0) or 0)  # PaliGemma-style processors
        return cls(model.loaded.tokenizer, image_tokens)

    def count(self, text: str) -> int:
        if not text:
            return 0
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def usage(self, prompt: str, has_image: bool, answer: str) -> dict[str, int]:
        prompt_tokens = self.count(prompt) + (self.image_tokens if has_image else 0)
        completion_tokens = self.count(answer)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
