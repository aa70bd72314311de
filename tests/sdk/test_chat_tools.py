"""`model.chat(messages, tools=..., tool_choice=...)`: tool calls valid by construction in every mode, in the
template's own format (Qwen's `<tool_call>`) or foveal's JSON one; follow-up turns with tool results;
thinking sections read back as `reasoning`; logprobs; seeds; the reply read back from a stream.

Models: tiny random Llamas carrying the chat templates of tests/families/chat_templates.py (random
weights: the tests check validity, plumbing and promises, not the answers' sense). Schemas are
closed and bounded so a random model's call ends within a few dozen tokens.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import foveal
from foveal import tools as chat_tools
from foveal.errors import IncompleteOutputError
from foveal.grammars import GrammarViolation, SchemaError
from tests.families.chat_templates import (
    NO_THINK_TEMPLATE,
    PLAIN_TEMPLATE,
    QWEN3_OPEN_TEMPLATE,
    QWEN3_TEMPLATE,
    build_llama_with_template,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
ASK = [{"role": "user", "content": "weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "max_tokens": 120}


def _load(folder):
    return foveal.load(folder, device="cpu", max_batch_size=8, max_model_len=2048)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"hermes": Qwen's tool format, no thinking; "json": a plain template; "section" / "open": thinking}."""
    root = tmp_path_factory.mktemp("chat_tools")
    templates = {"hermes": NO_THINK_TEMPLATE, "json": PLAIN_TEMPLATE, "section": QWEN3_TEMPLATE, "open": QWEN3_OPEN_TEMPLATE}
    loaded = {name: _load(build_llama_with_template(root / name, t)) for name, t in templates.items()}
    yield loaded
    for model in loaded.values():
        model.close()


@pytest.fixture
def short_thinking(monkeypatch):
    """A random model rarely writes `</think>` by itself: bound the thinking so it must, soon."""
    monkeypatch.setattr(chat_tools, "THINKING", "(?s:.{0,12})")


def assert_valid_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in (names or PARAMS)
        jsonschema.validate(call["arguments"], PARAMS[call["name"]])


@pytest.mark.parametrize("fmt", ["hermes", "json"])
def test_required_and_named_calls_are_valid_by_construction(models, fmt):
    model = models[fmt]
    for seed in range(3):
        settings = {**SAMPLED, "seed": seed}
        result = model.chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, settings=settings)
        assert_valid_calls(result["tool_calls"])
        assert len(result["tool_calls"]) == 1 and result["text"] == ""
        named = {"type": "function", "function": {"name": "add"}}
        result = model.chat(ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, settings=settings)
        assert_valid_calls(result["tool_calls"], ["add"])


def grammar_accepts(model, plan, text: str) -> bool:
    """Whether `text` (tokenized as the model would write it) is a complete answer under the plan's grammar."""
    matcher = model.family.compile(plan.spec).matcher()
    try:
        for token in model.family.tokenizer.encode(text, add_special_tokens=False):
            matcher.commit(token)
    except GrammarViolation:
        return False
    return matcher.is_accepting()


HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_auto_allows_text_or_a_valid_call_and_nothing_else(models):
    hermes = chat_tools.plan(None, TOOLS, "auto", True, "hermes")
    model = models["hermes"]
    assert grammar_accepts(model, hermes, "It is sunny.")
    assert grammar_accepts(model, hermes, "Let me add them.\n" + HERMES_CALL)
    assert grammar_accepts(model, hermes, HERMES_CALL + "\n" + HERMES_CALL)  # parallel calls
    assert not grammar_accepts(model, hermes, HERMES_CALL.replace('"a": 1', '"a": 100'))  # maximum 99
    assert not grammar_accepts(model, hermes, HERMES_CALL.replace("add", "sub"))  # no such tool
    assert not grammar_accepts(model, hermes, HERMES_CALL + " and more text")
    single = chat_tools.plan(None, TOOLS, "auto", False, "hermes")
    assert grammar_accepts(model, single, HERMES_CALL)
    assert not grammar_accepts(model, single, HERMES_CALL + "\n" + HERMES_CALL)  # parallel_tool_calls=False
    plain = chat_tools.plan(None, TOOLS, "auto", True, "json")
    call = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'
    assert grammar_accepts(models["json"], plain, "It is sunny.")
    assert grammar_accepts(models["json"], plain, call)
    assert not grammar_accepts(models["json"], plain, call.replace('"b": 2', '"c": 2'))


def test_auto_end_to_end_returns_text_or_valid_calls(models):
    for seed in range(3):
        try:
            result = models["hermes"].chat(ASK, tools=TOOLS, settings={**SAMPLED, "max_tokens": 40, "seed": seed})
        except IncompleteOutputError as cut:  # a random model's text runs to max_tokens
            assert "<tool_call>" not in cut.reply.text and not cut.reply.tool_calls
            continue
        if result["tool_calls"]:
            assert_valid_calls(result["tool_calls"])
        assert "<tool_call>" not in result["text"]


def test_none_leaves_the_answer_free(models):
    result = models["hermes"].chat(ASK, tools=TOOLS, tool_choice="none", settings={"max_tokens": 8})
    assert result["tool_calls"] == [] and result.usage.completion_tokens >= 1


class Submitted:
    def __init__(self, model, monkeypatch):
        self.requests = []
        submit = model.engine.submit
        monkeypatch.setattr(model.engine, "submit", lambda r: self.requests.append(r) or submit(r))


def test_a_follow_up_turn_with_the_tool_result_is_rendered_by_the_template(models, monkeypatch):
    model = models["hermes"]
    call = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "3"},
    ]
    spy = Submitted(model, monkeypatch)
    model.chat(messages, tools=TOOLS, tool_choice="none", settings={"max_tokens": 2})
    hf = [
        ASK[0],
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_7"},
    ]
    expected = model.family.tokenizer.apply_chat_template(hf, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert spy.requests[0].prompt_ids == list(expected)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, ValueError, "not among the tools"),
        ({"tool_choice": "always"}, ValueError, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, ValueError, "letters, digits"),
        ({"tools": TOOLS + TOOLS[:1]}, ValueError, "unique"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]},
            SchemaError,
            "uniqueItems",
        ),
        ({"output_type": {"type": "object"}}, ValueError, "cannot be combined"),
        ({"parallel_tool_calls": "no"}, TypeError, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_refused_before_any_work(models, monkeypatch, kwargs, error, match):
    model = models["hermes"]
    spy = Submitted(model, monkeypatch)
    with pytest.raises(error, match=match):
        model.chat(ASK, **{"tools": TOOLS, **kwargs})
    assert not spy.requests


def test_a_tool_message_must_answer_an_earlier_call(models):
    with pytest.raises(ValueError, match="answers no earlier"):
        models["hermes"].chat([*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    with pytest.raises(ValueError, match="needs tools"):
        models["hermes"].chat(ASK, tool_choice="required")


def test_a_model_without_a_chat_template_refuses_tools(llama_model):
    with pytest.raises(ValueError, match="no chat template"):
        llama_model.chat(ASK, tools=TOOLS)


@pytest.mark.parametrize("mode", ["section", "open"])
def test_thinking_is_free_and_the_structured_part_follows_it(models, short_thinking, mode):
    model = models[mode]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    result = model.chat(ASK, output_type=schema, settings={**SAMPLED, "seed": 1})
    assert isinstance(result["reasoning"], str) and "think>" not in result["reasoning"]
    assert isinstance(result["output"]["ok"], bool) and json.loads(result["text"]) == result["output"]
    called = model.chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, settings={**SAMPLED, "seed": 2})
    assert_valid_calls(called["tool_calls"])
    assert isinstance(called["reasoning"], str)


def test_a_thinking_section_is_one_grammar_with_what_follows(models):
    plan = chat_tools.plan({"type": "boolean"}, reasoning="section")
    model = models["section"]
    assert grammar_accepts(model, plan, "<think>anything\nat all</think>\n\ntrue")
    assert not grammar_accepts(model, plan, "<think>anything</think>maybe")
    assert not grammar_accepts(model, plan, "true")  # the section comes first
    opened = chat_tools.plan({"type": "boolean"}, reasoning="open")
    assert grammar_accepts(models["open"], opened, "hmm</think>false")


READ_CASES = [
    (chat_tools.ChatPlan(chat_tools.tools_of(TOOLS), "auto", True, "hermes", "section"),
     "<think>let me see</think>\n\nOn it.\n" + HERMES_CALL + "\n" + HERMES_CALL),
    (chat_tools.ChatPlan(chat_tools.tools_of(TOOLS), "required", True, "json", "open"),
     'mm</think>{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'),
    (chat_tools.ChatPlan(reasoning="section"), "<think>a < b</think>\n<tool_call> is plain text here"),
]


@pytest.mark.parametrize("plan, text", READ_CASES)
def test_a_reply_streamed_in_any_pieces_reads_as_the_whole(plan, text):
    whole = chat_tools.read_reply(plan, text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        reader = chat_tools.ReplyReader(plan)
        events = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
        joined = {kind: "".join(v for k, v in events if k == kind) for kind in ("reasoning", "content")}
        assert joined["content"] == whole.text and joined["reasoning"].strip("\n") == (whole.reasoning or "")
        calls, arguments = [], []  # as a client joins the deltas: a start, then argument pieces
        for kind, value in events:
            if kind == "call_start":
                calls.append(value["name"])
                arguments.append("")
            elif kind == "call_arguments":
                arguments[-1] += value
        assert [(n, json.loads(a)) for n, a in zip(calls, arguments, strict=True)] == [
            (c["name"], c["arguments"]) for c in whole.tool_calls
        ]


def test_logprobs_are_those_of_the_masked_distribution(models):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
    result = models["hermes"].chat(ASK, output_type=schema, settings={"temperature": 1.0, "seed": 3}, logprobs=3)
    entries = result["logprobs"]
    assert len(entries) == result.usage.completion_tokens
    assert "".join(e["token"] for e in entries) == result["text"]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) <= 3 for e in entries)
    assert entries[0]["token"] == "{" and entries[0]["logprob"] == 0.0  # forced by the grammar
    digit = next(e for e in entries if e["token"].isdigit())
    assert all(alt["token"].isdigit() for alt in digit["top_logprobs"])  # only allowed tokens compete
    assert bytes(digit["bytes"]).decode() == digit["token"]


def test_a_seeded_chat_repeats_exactly_and_streams_the_same_reply(models):
    settings = {**SAMPLED, "seed": 11}
    call = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "settings": settings}
    first = models["hermes"].chat(ASK, **call)
    again = models["hermes"].chat(ASK, **call)
    strip = lambda calls: [(c["name"], c["arguments"]) for c in calls]  # noqa: E731
    assert strip(first["tool_calls"]) == strip(again["tool_calls"])
    streamed = models["hermes"].chat(ASK, **call, stream=True)
    reply = chat_tools.read_reply(streamed["text"].plan, "".join(streamed["text"]))
    assert strip(reply.tool_calls) == strip(first["tool_calls"])
