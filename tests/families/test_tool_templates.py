"""Conversations with tools through the model's own chat template (families.template): Qwen's
`<tool_call>` format where the template defines it, foveal's JSON tool format elsewhere, and the
thinking section a template writes, read from a one-turn render."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from foveal.families.conversation import Message, ToolCall, ToolConversation, to_hf, tools_of, with_tools
from foveal.families.template import JSON_FORMAT_PROMPT, ChatTemplate
from tests.families.chat_templates import (
    NO_THINK_TEMPLATE,
    PLAIN_TEMPLATE,
    QWEN3_OPEN_TEMPLATE,
    QWEN3_TEMPLATE,
    build_llama_with_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "today's weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = build_llama_with_template(tmp_path_factory.mktemp("templates") / "llama", QWEN3_TEMPLATE)
    return AutoTokenizer.from_pretrained(folder)


def template(tokenizer, source: str) -> ChatTemplate:
    tokenizer.chat_template = source
    return ChatTemplate(tokenizer)


def follow_up() -> tuple[Message, ...]:
    return (
        Message("user", ("weather in Paris?",)),
        Message("assistant", (), (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", ("sunny, 21 C",), tool_call_id="call_1"),
    )


def test_a_template_with_tool_calls_gets_the_tools_and_the_calls_as_transformers_passes_them(tokenizer):
    chat = template(tokenizer, QWEN3_TEMPLATE)
    assert chat.tool_format == "hermes"
    text, _ = chat.render(with_tools(follow_up(), [WEATHER]))
    expected = tokenizer.apply_chat_template(
        to_hf(follow_up(), vision=False), tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    assert json.dumps(WEATHER) in text  # the tools, as the template lists them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_other_templates_get_foveals_json_tool_format_in_plain_turns(tokenizer):
    chat = template(tokenizer, PLAIN_TEMPLATE)
    assert chat.tool_format == "json"
    text, _ = chat.render(with_tools(follow_up(), [WEATHER]))
    system = JSON_FORMAT_PROMPT.format(tools=json.dumps(WEATHER))
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n")
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in text
    assert "<|im_start|>user\nResult of tool call call_1:\nsunny, 21 C<|im_end|>" in text
    with_system = (Message("system", ("Be brief.",)), *follow_up())
    assert chat.render(with_tools(with_system, [WEATHER]))[0].startswith(
        f"<|im_start|>system\nBe brief.\n\n{system}<|im_end|>"
    )


def test_the_thinking_section_is_read_from_the_template(tokenizer):
    assert template(tokenizer, QWEN3_TEMPLATE).reasoning == "section"
    assert template(tokenizer, QWEN3_OPEN_TEMPLATE).reasoning == "open"
    assert template(tokenizer, NO_THINK_TEMPLATE).reasoning is None
    assert template(tokenizer, PLAIN_TEMPLATE).reasoning is None


def test_a_conversation_with_tools_is_still_plain_hashable_data():
    plain = follow_up()
    tooled = with_tools(plain, [WEATHER])
    assert isinstance(tooled, ToolConversation) and tuple(tooled) == plain
    assert tooled != plain and tooled == with_tools(plain, [WEATHER]) and hash(tooled) == hash(with_tools(plain, [WEATHER]))
    assert tools_of(tooled) == [WEATHER] and tools_of(plain) == []
    assert with_tools(plain, []) is plain
