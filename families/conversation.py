"""A conversation as families render it: messages whose parts are text or a reference to an image.

The SDK turns a caller's OpenAI-style messages (`model.chat`) or a skill call (`query(image, q)` is one
user turn: the image, then the question) into a `Conversation`. Images are decoded by the SDK and
passed beside the conversation in order; a message part that is an image holds its index in that
list, so a conversation is plain, hashable data that a family renders without touching pixels.

`to_hf` gives the messages in transformers' chat-template format: content as a list of
`{"type": "text", "text": ..}` / `{"type": "image"}` parts for processors, or one string for text-only
tokenizers (most text templates expect a string).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    parts: tuple[str | int, ...]  # text, or the index of an image in the call's image list

    @property
    def text(self) -> str:
        """The message's text parts joined (images left out)."""
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def images(self) -> tuple[int, ...]:
        return tuple(p for p in self.parts if isinstance(p, int))


Conversation = tuple[Message, ...]


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


def to_hf(conversation: Conversation, vision: bool) -> list[dict]:
    """The conversation as transformers' `apply_chat_template` takes it."""
    if not vision:
        return [{"role": m.role, "content": m.text} for m in conversation]
    return [
        {
            "role": m.role,
            "content": [{"type": "image"} if isinstance(p, int) else {"type": "text", "text": p} for p in m.parts],
        }
        for m in conversation
    ]
