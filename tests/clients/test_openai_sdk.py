"""The official `openai` client, unchanged, against `foveal serve` with no `--model`: tools in every
tool_choice mode (streamed too), the tool's result relayed, a system prompt and follow-up turns, an
image in a later turn, n, logprobs, json_object, json_schema and `.parse()` with a small pydantic class.

Every answer must end by itself (finish_reason "stop" or "tool_calls", never "length") well within
the budget a user would give it.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.clients.conftest import (
    COUNT_SHAPES,
    TOOL_RESULT,
    Shape,
    check_count_call,
    count,
    image_part,
    present,
    scene,
    user,
)

openai = pytest.importorskip("openai")

# tokens: a call is about 90 of this tokenizer's mostly one-character tokens; a short answer or a small
# JSON object ends far before this. (The model has 512 positions: prompt + BUDGET must fit.)
BUDGET = 200
NAMED = {"type": "function", "function": {"name": "count_shapes"}}


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def ask_count(seed: int) -> tuple[list[dict], object]:
    obj = present(seed)
    return [user(f"how many {obj.colour} {obj.shape}s?", seed)], obj


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_a_counting_question_is_a_valid_call_of_the_tool(client, tool_choice):
    messages, obj = ask_count(1)
    reply = client.chat.completions.create(
        model="foveal",
        messages=messages,
        tools=[COUNT_SHAPES],
        tool_choice=tool_choice,
        max_completion_tokens=BUDGET,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    check_count_call(call.function.name, call.function.arguments, obj)


def test_a_streamed_calls_deltas_join_to_a_valid_call(client):
    messages, obj = ask_count(2)
    kwargs = {
        "model": "foveal",
        "messages": messages,
        "tools": [COUNT_SHAPES],
        "max_completion_tokens": BUDGET,
    }
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function.name == "count_shapes"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    check_count_call(deltas[0].function.name, arguments, obj)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_the_tools_result_is_relayed(client):
    messages, obj = ask_count(3)
    first = client.chat.completions.create(
        model="foveal", messages=messages, tools=[COUNT_SHAPES], max_completion_tokens=BUDGET
    )
    message = first.choices[0].message
    assert message.tool_calls, message.content
    call = message.tool_calls[0]
    follow_up = [
        *messages,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(TOOL_RESULT)},
    ]
    reply = client.chat.completions.create(
        model="foveal", messages=follow_up, tools=[COUNT_SHAPES], max_completion_tokens=BUDGET
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert str(TOOL_RESULT) in choice.message.content, (
        f"the tool said {TOOL_RESULT}: {choice.message.content!r}"
    )


def test_with_tools_offered_a_reply_is_text_or_a_valid_call_and_says_which(client):
    """tool_choice "auto": the reply is text (finish_reason "stop") or calls (finish_reason
    "tool_calls") of the declared tool with valid arguments. Whether the model leaves a question no
    tool answers to text is its accuracy: training/eval_chat.py, no_tool_needed_text."""
    reply = client.chat.completions.create(
        model="foveal",
        messages=[user("what color is the circle?", 0)],
        tools=[COUNT_SHAPES],
        tool_choice="auto",
        max_completion_tokens=BUDGET,
    )
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name == "count_shapes"
            assert set(json.loads(call.function.arguments)) == {"colour", "shape"}
    else:
        assert choice.finish_reason == "stop" and choice.message.content.strip()


def test_a_system_prompt_and_a_follow_up_question(client):
    seed = 4
    messages = [
        {"role": "system", "content": "Answer briefly."},
        user("how many circles?", seed),
        {"role": "assistant", "content": str(count(seed, "circles"))},
        {"role": "user", "content": "and how many squares?"},
    ]
    reply = client.chat.completions.create(model="foveal", messages=messages, max_completion_tokens=BUDGET)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    # a count, answered in the conversation's terms; whether it is the right one is the model's
    # accuracy on follow-ups (training/eval_chat.py, follow_up), not the API's
    assert choice.message.content.strip().isdigit(), choice.message.content


def test_an_image_in_a_later_turn_is_the_one_asked_about(client):
    messages = [
        user("how many shapes?", 5),
        {"role": "assistant", "content": str(count(5, "shapes"))},
        {"role": "user", "content": [{"type": "text", "text": "how many shapes?"}, image_part(6)]},
    ]
    reply = client.chat.completions.create(model="foveal", messages=messages, max_completion_tokens=BUDGET)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content.strip() == str(count(6, "shapes"))


def test_n_seeded_choices_repeat(client):
    kwargs = {
        "model": "foveal",
        "messages": [user("describe the image", 7)],
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
        "max_completion_tokens": BUDGET,
    }
    first = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert all(c.finish_reason == "stop" and c.message.content for c in first.choices)
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_logprobs_cover_the_answer(client):
    reply = client.chat.completions.create(
        model="foveal",
        messages=[user("how many shapes?", 8)],
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=BUDGET,
    )
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert choice.finish_reason == "stop"
    assert "".join(e.token for e in entries).strip() == choice.message.content.strip()
    assert all(e.logprob <= 0 and len(e.top_logprobs) <= 2 for e in entries)


def test_json_object_is_a_small_finished_object(client):
    reply = client.chat.completions.create(
        model="foveal",
        messages=[user("describe the scene", 9)],
        response_format={"type": "json_object"},
        max_completion_tokens=BUDGET,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_is_valid(client):
    schema = Shape.model_json_schema()
    reply = client.chat.completions.create(
        model="foveal",
        messages=[user("what shape is there, and how many?", 10)],
        response_format={"type": "json_schema", "json_schema": {"name": "shape", "schema": schema}},
        max_completion_tokens=BUDGET,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("where", ["chat", "beta"])
def test_parse_gives_the_pydantic_object(client, where):
    completions = client.chat.completions if where == "chat" else client.beta.chat.completions
    seed = 11
    reply = completions.parse(  # raised LengthFinishReasonError while open JSON never ended (issue 37)
        model="foveal", messages=[user("describe the main shape", seed)], response_format=Shape
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Shape)
    assert parsed.shape in {o.shape for o in scene(seed).objects}


def test_parse_with_a_pydantic_function_tool(client):
    messages, obj = ask_count(12)
    tool = openai.pydantic_function_tool(
        Shape, name="report_shape", description="report a shape and its count"
    )
    reply = client.chat.completions.parse(
        model="foveal", messages=messages, tools=[tool], tool_choice="required", max_completion_tokens=BUDGET
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "report_shape" and isinstance(call.function.parsed_arguments, Shape)
