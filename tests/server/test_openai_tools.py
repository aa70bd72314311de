"""OpenAI's chat API as agents use it, against the real `openai` client: conversations (system, several
turns, images in two turns), tools in every tool_choice mode (streamed as tool-call deltas), follow-up
turns with tool results, n, seed, logprobs, thinking as `reasoning_content`, and the 400s of bad input.

Models: tiny random Llamas with the chat templates of tests/families/chat_templates.py, and a tiny
Qwen2.5-VL (several images per call), behind real servers; random weights, so the tests check what
the API promises (validity, shapes, repeatability), not the answers' sense.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import jsonschema
import pytest

import foveal
from foveal import tools as chat_tools
from foveal.server import create_app
from foveal.server.background import BackgroundServer
from foveal.testing import tiny
from tests.families.chat_templates import NO_THINK_TEMPLATE, QWEN3_TEMPLATE, build_llama_with_template
from tests.server.conftest import all_pages_free, data_url, scene

openai = pytest.importorskip("openai")

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
]
SCHEMAS = {"add": ADD, "get_weather": CITY}
ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "what is 2 + 3?"}]
REQUIRED = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
SAMPLED = {"temperature": 1.0, "seed": 5, "max_completion_tokens": 120}


def _serve(folder, stack: contextlib.ExitStack):
    model = foveal.load(folder, device="cpu", max_batch_size=8, max_model_len=2048)
    stack.callback(model.close)
    url = stack.enter_context(BackgroundServer(create_app(model)))
    return model, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """name -> (model, openai client): "tools" (Qwen's tool format), "thinking" (a thinking section too)."""
    root = tmp_path_factory.mktemp("openai_tools")
    with contextlib.ExitStack() as stack:
        yield {
            "tools": _serve(build_llama_with_template(root / "tools", NO_THINK_TEMPLATE), stack),
            "thinking": _serve(build_llama_with_template(root / "thinking", QWEN3_TEMPLATE), stack),
        }


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tiny.build("qwen2_5_vl", tmp_path_factory.mktemp("openai_qwen") / "qwen2_5_vl")
    model = foveal.load(folder, device="cpu", max_batch_size=8, max_model_len=1024)
    with BackgroundServer(create_app(model)) as url:
        yield model, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    model.close()


def image_part(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(scene(seed, 48))}}


def test_system_several_turns_and_images_in_two_turns_are_the_sdks_chat(qwen):
    model, client = qwen
    messages = [
        {"role": "system", "content": "You count shapes."},
        {"role": "user", "content": [image_part(1), {"type": "text", "text": "how many?\nbe brief"}]},
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": [{"type": "text", "text": "and here?"}, image_part(2)]},
    ]
    reply = client.chat.completions.create(
        model="foveal", messages=messages, max_completion_tokens=6, user="u1", metadata={"run": "t"},
        safety_identifier="u1", prompt_cache_key="shapes",  # what the openai client documents in user's place
    )
    sdk = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
            {"type": "image", "image": _decoded(p)} if p["type"] == "image_url" else p for p in m["content"]
        ]}
        for m in messages
    ]
    assert reply.choices[0].message.content == model.chat(sdk, settings={"max_tokens": 6})["text"]
    streamed = client.chat.completions.create(model="foveal", messages=messages, max_completion_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content


def _decoded(part: dict) -> bytes:
    import base64

    return base64.b64decode(part["image_url"]["url"].split(",", 1)[1])


def test_required_calls_are_valid_tool_calls_with_their_finish_reason(servers):
    _, client = servers["tools"]
    for seed in range(3):
        reply = client.chat.completions.create(model="foveal", messages=ASK, **REQUIRED, **{**SAMPLED, "seed": seed})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="foveal", messages=ASK, tools=TOOLS, tool_choice=named, **SAMPLED)
    assert {c.function.name for c in reply.choices[0].message.tool_calls} == {"get_weather"}


def accumulate(chunks) -> tuple[list[dict], str | None, str]:
    """Tool calls, finish_reason and content of a stream, joined as agent frameworks join the deltas."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_streamed_tool_calls_are_deltas_that_join_to_the_whole_answer(servers):
    model, client = servers["tools"]
    whole = client.chat.completions.create(model="foveal", messages=ASK, **REQUIRED, **SAMPLED)
    calls, finish, content = accumulate(
        client.chat.completions.create(model="foveal", messages=ASK, **REQUIRED, **SAMPLED, stream=True)
    )
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
    assert finish == "tool_calls" and content == "" and all(c["id"].startswith("call_") for c in calls)
    assert all_pages_free(model)


def test_auto_answers_text_or_a_valid_call(servers):
    _, client = servers["tools"]
    for seed in range(2):
        reply = client.chat.completions.create(model="foveal", messages=ASK, tools=TOOLS, **{**SAMPLED, "seed": seed, "max_completion_tokens": 30})
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert "<tool_call>" not in (choice.message.content or "")


def test_a_follow_up_turn_with_the_tool_result_is_answered(servers):
    _, client = servers["tools"]
    first = client.chat.completions.create(model="foveal", messages=ASK, **REQUIRED, **SAMPLED)
    message = first.choices[0].message
    follow = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"},
    ]
    reply = client.chat.completions.create(model="foveal", messages=follow, tools=TOOLS, tool_choice="none", max_completion_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None


def error_of(client, **request) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="foveal", **request)
    return caught.value.body


def test_bad_tools_and_choices_are_400s_with_json_bodies(servers):
    model, client = servers["tools"]
    unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    body = error_of(client, messages=ASK, tools=[{"type": "function", "function": {"name": "f", "parameters": unique}}])
    assert "uniqueItems" in body["message"] and body["code"] == "unsupported_schema"
    assert body["param"] == "tools[0].function.parameters"
    named = {"type": "function", "function": {"name": "sub"}}
    body = error_of(client, messages=ASK, tools=TOOLS, tool_choice=named)
    assert "sub" in body["message"] and body["param"] == "tool_choice"
    body = error_of(client, messages=[*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "5"}])
    assert "answers no earlier" in body["message"]
    assert "top_logprobs" in error_of(client, messages=ASK, top_logprobs=2)["message"]
    assert "n=9" in error_of(client, messages=ASK, n=9)["message"]
    assert all_pages_free(model)


def test_n_choices_share_the_prompt_and_a_seeded_request_repeats(servers):
    model, client = servers["tools"]
    request = {"messages": ASK, "n": 3, "temperature": 1.0, "seed": 9, "max_completion_tokens": 5}
    reply = client.chat.completions.create(model="foveal", **request)
    again = client.chat.completions.create(model="foveal", **request)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and texts == [c.message.content for c in again.choices]
    single = [
        client.chat.completions.create(model="foveal", messages=ASK, temperature=1.0, seed=9 + i, max_completion_tokens=5)
        for i in range(3)
    ]
    assert [s.choices[0].message.content for s in single] == texts  # choice i has the seed seed + i
    assert reply.usage.prompt_tokens == single[0].usage.prompt_tokens  # the prompt counted once
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    streamed: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="foveal", **request, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == texts and sorted(finishes) == [0, 1, 2]
    assert all_pages_free(model)


def test_logprobs_whole_and_streamed(servers):
    _, client = servers["tools"]
    request = {"messages": ASK, "logprobs": True, "top_logprobs": 2, "temperature": 1.0, "seed": 4, "max_completion_tokens": 6}
    reply = client.chat.completions.create(model="foveal", **request)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) <= 2 and e.bytes is not None for e in entries)
    streamed = [
        e for c in client.chat.completions.create(model="foveal", **request, stream=True)
        for choice in c.choices if choice.logprobs is not None for e in choice.logprobs.content or []
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = client.chat.completions.create(model="foveal", messages=ASK, max_completion_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.fixture
def short_thinking(monkeypatch):
    """The random model must close its thinking soon: bound the section (the server runs in this process)."""
    monkeypatch.setattr(chat_tools, "THINKING", "(?s:.{0,12})")


def test_thinking_is_reasoning_content_and_the_schema_constrains_what_follows(servers, short_thinking):
    _, client = servers["thinking"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    request = {"messages": ASK, "response_format": response_format, **SAMPLED}
    reply = client.chat.completions.create(model="foveal", **request)
    message = reply.choices[0].message
    assert isinstance(message.model_extra["reasoning_content"], str)
    jsonschema.validate(json.loads(message.content), schema)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="foveal", **request, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert content == message.content and reasoning.strip("\n") == message.model_extra["reasoning_content"]
    called = client.chat.completions.create(model="foveal", messages=ASK, **REQUIRED, **SAMPLED)
    assert called.choices[0].finish_reason == "tool_calls"
    assert isinstance(called.choices[0].message.model_extra["reasoning_content"], str)


def test_raw_bodies_are_openais_shape(servers):
    """The fields agents read, checked on the JSON itself (not through the client's models)."""
    _, client = servers["tools"]
    url = str(client.base_url).rstrip("/")
    body = httpx.post(f"{url}/chat/completions", json={"messages": ASK, **REQUIRED, **SAMPLED}, timeout=120).json()
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert set(call) == {"id", "type", "function"} and isinstance(call["function"]["arguments"], str)
