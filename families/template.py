"""Prompts rendered by the model's own chat template, tokenized exactly as transformers tokenizes them.

`ChatTemplate.render(conversation)` gives the prompt text and whether its tokenization adds special
tokens, following transformers' `apply_chat_template(..., tokenize=True)`:
- a processor (vision families) renders with its own template; the text is tokenized with the
  processor's defaults unless it already starts with BOS (then without special tokens), which is
  the processor's rule;
- a tokenizer (text families) renders with its template and never adds special tokens.
So foveal's prompt ids are the ids transformers gives for the same messages, images included
(tests/models/test_templates.py compares them). Rendering is Jinja only (no tokenizer state), so it
is safe from many threads at once.

A checkpoint without a chat template has no conversation format: one user turn is written as
"Question: <text>\\nAnswer:" (image placeholders first), and a system message or several turns are
refused by the family with a message that says so.
"""

from __future__ import annotations

from typing import Any

from foveal.families.conversation import Conversation, single_user_message, to_hf


class ChatTemplate:
    def __init__(self, tokenizer: Any, hf_processor: Any = None, image_token: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vision = hf_processor is not None
        self._processor = hf_processor if getattr(hf_processor, "chat_template", None) else None
        self._tokenizer_has = bool(getattr(tokenizer, "chat_template", None))
        self.image_token = image_token

    @property
    def available(self) -> bool:
        return self._processor is not None or self._tokenizer_has

    def render(self, conversation: Conversation) -> tuple[str, bool]:
        """(prompt text, add_special_tokens) for `conversation`, ending with the assistant's turn opened."""
        if self._processor is not None:
            text = self._processor.apply_chat_template(
                to_hf(conversation, vision=True), tokenize=False, add_generation_prompt=True
            )
            bos = getattr(self.tokenizer, "bos_token", None)
            return text, not (bos is not None and text.startswith(bos))
        if self._tokenizer_has:
            text = self.tokenizer.apply_chat_template(
                to_hf(conversation, vision=self.vision), tokenize=False, add_generation_prompt=True
            )
            return text, False
        return self._plain(conversation), True

    def _plain(self, conversation: Conversation) -> str:
        message = single_user_message(conversation, "this checkpoint")
        images = (self.image_token or "") * len(message.images)
        return f"Question: {images + chr(10) if images else ''}{message.text}\nAnswer:"
