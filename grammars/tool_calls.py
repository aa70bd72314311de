"""The Lark grammar of a chat reply: an optional thinking section, then text, an output type or tool calls.

The SDK's chat plan (foveal.tools) decides what a reply may be; this module writes it as ONE Lark
grammar (llguidance dialect), and checks a tool's parameter schema the way compile would:

    [thinking]  free text in the template's thinking section (`<think>...</think>`, or from the
                generation prompt's open `<think>` up to `</think>`): `with_thinking`
    then the answer (`start` reaches it as the rule `answer`), one of
      output    the output type's JSON schema (`%json`) or regex: `output_rules`
      calls     tool calls in the template's format: "hermes",
                `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>` (several, one per line,
                where parallel calls are allowed), or "json", `{"tool_calls": [..]}`; each call one
                `%json` schema whose name is a `const` and whose arguments are the tool's
                parameters, so a call is valid by construction: `call_rules`
      auto      text OR calls: hermes text holds no `<tool_call>` until the calls start (text may
                come first, as Qwen writes it); json text does not start with `{`.
INVARIANT (tests/sdk/test_chat_tools.py): every reply the grammar accepts is one the plan reads back,
its calls naming the given tools with arguments valid against their schemas.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import llguidance

from .errors import schema_refusal
from .specs import JSON_OPTIONS, grammar_source, json_schema_source

THINKING = "(?s:.*)"  # what the thinking section may hold unless the caller bounds it: anything


@functools.lru_cache(maxsize=256)
def enforced_parameters(parameters: str) -> dict:
    """A tool's parameters schema (its JSON text) as the grammar enforces it, after checking llguidance
    takes it (what compile would refuse, found without a tokenizer); SchemaError otherwise. Cached: a
    server checks a request's tools before any work, and every chat call checks them again. The
    result is shared: read-only."""
    source = json_schema_source(json.loads(parameters))
    refused, problems = llguidance.LLMatcher.validate_grammar_with_warnings(source.grammar)
    if refused:
        raise schema_refusal("; ".join(problems), source.schema)
    return source.schema


def with_thinking(reasoning: str | None, answer_rules: str, thinking: str = THINKING) -> str:
    """The whole grammar: `start` = the thinking section, if any ("section": it opens with `<think>`;
    "open": the prompt opened it), holding `thinking` (a regex), then `answer`."""
    if reasoning == "section":
        head = f"start: think SEP answer\nthink[lazy]: /<think>{thinking}<\\/think>/\nSEP: /\\n*/\n"
    elif reasoning == "open":
        head = f"start: think SEP answer\nthink[lazy]: /{thinking}<\\/think>/\nSEP: /\\n*/\n"
    else:
        head = "start: answer\n"
    return head + answer_rules


def output_rules(output_type: Any) -> tuple[str, Callable[[str], Any]]:
    """Lark rules `answer: ..` of an output type that follows a thinking section, and its parser."""
    source = grammar_source(output_type)
    if source.kind == "json_schema":
        return f"answer: {_json(source.schema)}\n", source.parse
    if source.kind == "regex" and source.pattern is not None:
        return f"answer: ANSWER\nANSWER: /{_lark_regex(source.pattern)}/\n", source.parse
    raise ValueError(
        "this model writes a thinking section first, so its output type must be a JSON schema, a pydantic "
        "model or a Regex (which can follow the free thinking in one grammar); use one of those"
    )


def call_rules(tools: Sequence[tuple[str, dict]], auto: bool, parallel: bool, tool_format: str) -> str:
    """Lark rules `answer: ..` of calls to `tools` ((name, enforced parameters) pairs, at least one),
    in `tool_format` ("hermes" or "json"); `auto`: text instead of calls is allowed too."""
    schemas = [_call_schema(name, parameters) for name, parameters in tools]
    if tool_format == "hermes":
        rules = "".join(f"f{i}: {_json(s)}\n" for i, s in enumerate(schemas))
        rules += "call: " + " | ".join(f"f{i}" for i in range(len(schemas))) + "\n"
        one = '"\\n</tool_call>"'
        more = ' ("\\n<tool_call>\\n" call "\\n</tool_call>")*' if parallel else ""
        rules += f"calls: call {one}{more}\n"
        if auto:
            return (
                "answer: TEXT | head calls\n"
                "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
                "head[lazy]: /(?s:.*)<tool_call>\\n/\n" + rules
            )
        return 'answer: "<tool_call>\\n" calls\n' + rules
    items: dict[str, Any] = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
    array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    wrapper = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if auto:
        return f"answer: TEXT | calls\nTEXT: /([^{{](?s:.*))?/\ncalls: {_json(wrapper)}\n"
    return f"answer: {_json(wrapper)}\n"


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json(schema: dict) -> str:
    """`%json {..}` of a schema under foveal's JSON options (grammars.specs: compact, one style)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _lark_regex(pattern: str) -> str:
    return pattern.replace("/", "\\/")
