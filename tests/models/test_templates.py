"""Prompts come from the model's own chat template: foveal's prompt ids are transformers' ids for the same messages.

The reference is what a transformers user runs: `processor.apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)` with the images in the messages (Qwen-VL), `tokenizer.apply_chat_template`
for a text model with a real template (SmolLM2's, shipped in foveal.testing). The same conversations go
through `family.chat` + `family.encode`, as `model.chat` runs them; skill calls (one user turn) are checked
the same way, so a detect prompt is the template's too.
"""

from __future__ import annotations

import pytest
import transformers as tf
from PIL import Image

from foveal.engine.models import Architecture, InputProcessor, LoadedModel
from foveal.families import load
from foveal.families.chat import ChatFamily
from foveal.families.conversation import Message
from foveal.testing import SMOLLM2_TOKENIZER, tiny, tiny_qwen

PICTURES = [Image.new("RGB", (w, h), (40 * i, 90, 200 - 30 * i)) for i, (w, h) in enumerate([(64, 48), (40, 90)])]

CONVERSATIONS = {
    "one image": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
    "system + image after text": [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "look:\nhere"}, {"type": "image"}]},
    ],
    "two turns, two images": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a square"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and that one?"}]},
    ],
    "text only": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
}


def _ours(messages: list[dict]) -> tuple[tuple[Message, ...], list[Image.Image]]:
    """The messages as foveal's conversation and its images (as foveal.skills.conversation builds them)."""
    images, out = [], []
    for m in messages:
        parts = []
        for part in m["content"]:
            if part["type"] == "image":
                parts.append(len(images))
                images.append(PICTURES[len(images)])
            else:
                parts.append(part["text"])
        out.append(Message(m["role"], tuple(parts)))
    return tuple(out), images


def _with_images(messages: list[dict]) -> list[dict]:
    count = iter(range(10))
    return [
        {
            "role": m["role"],
            "content": [
                {"type": "image", "image": PICTURES[next(count)]} if p["type"] == "image" else p for p in m["content"]
            ],
        }
        for m in messages
    ]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_templates")
    return {name: load(tiny.build(name, root / name), device="cpu") for name in tiny_qwen.FAMILIES}


@pytest.mark.parametrize("name", tiny_qwen.FAMILIES)
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_qwen_prompt_ids_are_the_processors_chat_template_ids(qwen, name, case):
    family = qwen[name]
    messages = CONVERSATIONS[case]
    conversation, images = _ours(messages)
    prompt, _ = family.encode(family.chat(conversation, None), images, "key" if images else None)
    reference = family.processor.hf_processor.apply_chat_template(
        _with_images(messages), tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    assert prompt.token_ids == reference["input_ids"][0].tolist()
    if images:
        assert prompt.prefill.image_tensors["pixel_values"].shape == reference["pixel_values"].shape


@pytest.mark.parametrize("name", tiny_qwen.FAMILIES)
def test_a_skill_call_is_one_user_turn_of_the_template(qwen, name):
    family = qwen[name]
    task = family.detect("red circle", 5)
    prompt, _ = family.encode(task, [PICTURES[0]], "key")
    messages = [{"role": "user", "content": [{"type": "image", "image": PICTURES[0]}, {"type": "text", "text": task.prompt}]}]
    reference = family.processor.hf_processor.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    assert prompt.token_ids == reference["input_ids"][0].tolist()


def test_a_real_text_template_gives_the_tokenizers_chat_ids():
    """SmolLM2's own template (a default system turn, no BOS in the template)."""
    tokenizer = tf.AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    arch = Architecture("llama", ("LlamaForCausalLM",))
    processor = InputProcessor(arch, tokenizer, None, device=None, dtype=None)
    family = ChatFamily(LoadedModel(None, tokenizer, processor, (), "smollm2"), arch)
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Hello\nthere"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "And goodbye?"},
        ],
    ):
        conversation = tuple(Message(m["role"], (m["content"],)) for m in messages)
        prompt, _ = family.encode(family.chat(conversation, None), [], None)
        reference = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        reference = reference["input_ids"] if hasattr(reference, "keys") else reference
        assert prompt.token_ids == list(reference)
