"""A conversation as families render it: messages whose parts are text or a reference to an image.

The SDK turns a caller's OpenAI-style messages (`model.chat`) or a skill call (`query(image, q)` is one
user turn: the image, then the question) into a `Conversation`. Images are decoded by the SDK and
passed beside the conversation in order; a message part that is an image holds its index in that
list, so a conversation is plain, hashable data that a family renders without touching pixels.

`to_hf` gives the messages in transformers' chat-template format: content as a list of
`{"type": "text", "text": ..}` / `{"type": "image"}` parts for processors, or one string for text-only
tokenizers (most text templates expect a string); an assistant's tool calls as `tool_calls` (OpenAI's
`{"type": "function", "function": {"name", "arguments"}}`, arguments a dict), a tool's result with
its `tool_call_id` (the names transformers' tool-use templates read).

Tools: the functions a model may call travel with the conversation (`with_tools`), as JSON texts
of OpenAI's tool definitions, so the family's template renders them where it renders the messages
(`tools_of`). A conversation without tools is a plain tuple of messages; with tools it is still
one (a `ToolConversation`, equal only to one with the same tools).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
# The markers of the thinking section and of tool calls where a chat template writes them (Qwen's).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call an assistant made: its id (the tool message that answers it names it), the function's
    name and its arguments as JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    parts: tuple[str | int, ...]  # text, or the index of an image in the call's image list
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @property
    def text(self) -> str:
        """The message's text parts joined (images left out)."""
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def images(self) -> tuple[int, ...]:
        return tuple(p for p in self.parts if isinstance(p, int))


Conversation = tuple[Message, ...]


class ToolConversation(tuple):
    """A conversation (a tuple of messages) with the tools its model may call (`tools`: JSON texts of
    OpenAI's `{"type": "function", "function": {...}}` definitions)."""

    tools: tuple[str, ...]

    def __new__(cls, messages: Conversation, tools: tuple[str, ...]) -> ToolConversation:
        conversation = super().__new__(cls, messages)
        conversation.tools = tuple(tools)
        return conversation

    def __eq__(self, other: object) -> bool:
        return tuple.__eq__(self, other) and self.tools == getattr(other, "tools", ())

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((tuple(self), self.tools))

    def __reduce__(self) -> tuple:
        return ToolConversation, (tuple(self), self.tools)


def with_tools(conversation: Conversation, tools: list[dict] | tuple[dict, ...]) -> Conversation:
    """`conversation` carrying `tools` (OpenAI tool definitions) for the template; unchanged without tools."""
    if not tools:
        return conversation
    return ToolConversation(tuple(conversation), tuple(json.dumps(t, ensure_ascii=False) for t in tools))


def tools_of(conversation: Conversation) -> list[dict]:
    """The tool definitions a conversation carries ([] for none)."""
    return [json.loads(t) for t in getattr(conversation, "tools", ())]


def user_turn(text: str, images: int = 0) -> Conversation:
    """One user message asking `text` about `images` images (placed first, as the model cards show)."""
    return (Message("user", (*range(images), text)),)


def single_user_message(conversation: Conversation, model: str) -> Message:
    """The conversation's one user message; ValueError for anything more, where `model` ("this
    checkpoint", "this paligemma model") has no chat template to hold it."""
    if len(conversation) != 1 or conversation[0].role != "user":
        raise ValueError(
            f"{model} has no chat template, so it takes one user message (no system message, no earlier "
            "turns); a checkpoint whose tokenizer has a chat_template holds conversations"
        )
    return conversation[0]


def image_count(conversation: Conversation) -> int:
    return sum(len(m.images) for m in conversation)


def task_conversation(prompt: str | Conversation, images: int) -> Conversation:
    """A task's conversation: a chat call's own (checked against the images that came), or one user
    turn asking `prompt` about them."""
    if not isinstance(prompt, tuple):
        return user_turn(prompt, images)
    if image_count(prompt) != images:
        raise ValueError(f"the conversation refers to {image_count(prompt)} images but {images} came")
    return prompt


def to_hf(conversation: Conversation, vision: bool) -> list[dict]:
    """The conversation as transformers' `apply_chat_template` takes it."""
    return [_hf_message(m, vision) for m in conversation]


def _hf_message(message: Message, vision: bool) -> dict:
    if vision:
        content: str | list = [
            {"type": "image"} if isinstance(p, int) else {"type": "text", "text": p} for p in message.parts
        ]
    else:
        content = message.text
    out: dict = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
