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

Tools (`conversation.with_tools`) are rendered in one of two formats, `tool_format`:
- "hermes": the template defines its own tool calls, `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`
  (Qwen2.5 / Qwen3, Hermes): the tools, the assistant's earlier calls and the tool results go to the
  template as transformers passes them (`tools=`, `tool_calls`, role "tool");
- "json" (every other template): foveal's documented format. The tools and the answer format
  (`{"tool_calls": [{"name": .., "arguments": {..}}]}`, JSON_FORMAT_PROMPT) are written into the
  system message (one is added first if there is none), an earlier call is written as that JSON in
  the assistant's turn, and a tool's result becomes a user turn that names its call.

Reasoning (`reasoning`): a template that writes a thinking section (Qwen3 style `<think>...</think>`)
either leaves it to the model ("section": the answer starts with `<think>`) or opens it in the
generation prompt ("open": the answer starts inside it); None where there is none, or where the
template closes it empty (thinking turned off).

A checkpoint without a chat template has no conversation format: one user turn is written as
"Question: <text>\\nAnswer:" (image placeholders first), and a system message or several turns are
refused by the family with a message that says so.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from foveal.families.conversation import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_OPEN,
    Conversation,
    Message,
    single_user_message,
    to_hf,
    tools_of,
)

JSON_FORMAT_PROMPT = (
    "You can call these tools (JSON definitions, one per line):\n{tools}\n\n"
    "To call tools, answer with JSON only, in this form: "
    '{{"tool_calls": [{{"name": <tool name>, "arguments": <arguments object>}}]}}. '
    "Otherwise answer in plain text."
)


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

    @functools.cached_property
    def source(self) -> str:
        """The template's Jinja text ("" without one; named templates joined)."""
        owner = self._processor if self._processor is not None else self.tokenizer
        template = getattr(owner, "chat_template", None) if self.available else None
        if isinstance(template, dict):
            return "\n".join(str(t) for t in template.values())
        return str(template or "")

    @property
    def tool_format(self) -> str:
        """"hermes" where the template writes `<tool_call>` itself, else "json" (the module docstring)."""
        return "hermes" if TOOL_CALL_OPEN in self.source else "json"

    @functools.cached_property
    def reasoning(self) -> str | None:
        """"section", "open" or None (the module docstring), read from a one-message render."""
        if THINK_OPEN not in self.source:
            return None
        try:
            text, _ = self.render((Message("user", ("hi",)),))
        except Exception:  # a template that cannot render a plain turn has no usable thinking section
            return None
        tail = text.rstrip()
        if tail.endswith(THINK_CLOSE):
            return None
        return "open" if tail.endswith(THINK_OPEN) else "section"

    def render(self, conversation: Conversation) -> tuple[str, bool]:
        """(prompt text, add_special_tokens) for `conversation`, ending with the assistant's turn opened."""
        tools = tools_of(conversation)
        extra: dict[str, Any] = {}
        if self.available and self.tool_format == "hermes":
            if tools:
                extra["tools"] = tools
        elif tools or any(m.tool_calls or m.role == "tool" for m in conversation):
            conversation = json_tool_turns(conversation, tools)
        if self._processor is not None:
            text = self._processor.apply_chat_template(
                to_hf(conversation, vision=True), tokenize=False, add_generation_prompt=True, **extra
            )
            bos = getattr(self.tokenizer, "bos_token", None)
            return text, not (bos is not None and text.startswith(bos))
        if self._tokenizer_has:
            text = self.tokenizer.apply_chat_template(
                to_hf(conversation, vision=self.vision), tokenize=False, add_generation_prompt=True, **extra
            )
            return text, False
        return self._plain(conversation), True

    def _plain(self, conversation: Conversation) -> str:
        message = single_user_message(conversation, "this checkpoint")
        images = (self.image_token or "") * len(message.images)
        return f"Question: {images + chr(10) if images else ''}{message.text}\nAnswer:"


def json_tool_turns(conversation: Conversation, tools: list[dict]) -> Conversation:
    """The conversation in foveal's JSON tool format, as plain turns any template renders (the module
    docstring): the tools in the system message, calls as JSON text, results as user turns."""
    out: list[Message] = []
    for message in conversation:
        if message.tool_calls:
            calls = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in message.tool_calls]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append(Message("assistant", (*message.parts, text)))
        elif message.role == "tool":
            out.append(Message("user", (f"Result of tool call {message.tool_call_id}:\n", *message.parts)))
        else:
            out.append(Message(message.role, message.parts))
    if tools:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = JSON_FORMAT_PROMPT.format(tools=lines)
        if out and out[0].role == "system":
            out[0] = Message("system", (*out[0].parts, "\n\n" + prompt))
        else:
            out.insert(0, Message("system", (prompt,)))
    return tuple(out)
