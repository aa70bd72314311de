"""Tools, reasoning and logprobs of `model.chat`: the one output grammar of a chat call, and its reply read back.

PROBLEM
    An agent sends a conversation, the functions the model may call (`tools`, JSON-schema parameters)
    and how it may call them (`tool_choice`), to a model whose chat template may write a thinking
    section first. The reply must be a tool call whose arguments are valid against the schema in
    every mode, `auto` included (where a model could also answer in text), and whatever follows a
    thinking section must still match the call's output type. Streams must tell the thinking, the
    text and the calls apart as they arrive.
SOLUTION
    `plan(...)` turns the call into a `ChatPlan` before any work: the tools checked and their
    parameter schemas compiled on their own (a schema the grammar cannot enforce raises SchemaError
    naming it), the choice resolved, and ONE Lark grammar written by `foveal.grammars.tool_calls`:
    the thinking section (if the template writes one), then free text (no grammar at all when
    nothing else constrains the call), the output type, tool calls in the template's format
    (`families.template`: "hermes" or "json"), or, with tool_choice "auto", text or calls.
    `ReplyReader` reads the reply's text, whole or delta by delta, into events: reasoning text,
    answer text, and each tool call once its text is complete (its id made here). `read_reply`
    is the whole-text twin and gives the parsed reply (`Reply`).
INVARIANTS (tests/sdk/test_chat_tools.py)
    - Every reply the grammar accepts reads back: its calls name declared tools and their
      arguments parse as JSON objects valid against the tool's schema.
    - Streamed events joined equal the whole reply's fields, however the text is split.
    - Bad tools, choices or messages raise before any request is submitted.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from foveal.families.conversation import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Conversation,
    ToolCall,
    with_tools,
)
from foveal.grammars import CFG, SchemaError, tool_calls
from foveal.grammars.tokenizer import tokenizer_handle
from foveal.results import AsyncTextStream, TextStream

MAX_TOOLS = 128  # OpenAI's limit on tools per request
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
THINKING = tool_calls.THINKING  # what the thinking section may hold: anything (a test may bound it)
_CALL_START = TOOL_CALL_OPEN + "\n"
_CALL_END = "\n" + TOOL_CALL_CLOSE
_CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call: its name, its OpenAI definition (what the template renders)
    and its parameters' JSON schema as the grammar enforces it."""

    name: str
    definition: dict
    parameters: dict


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """How one chat call is decoded and read back (the module docstring)."""

    tools: tuple[Tool, ...] = ()
    choice: str = "none"  # none | auto | required | a tool's name
    parallel: bool = True
    tool_format: str = "json"  # hermes | json (families.template)
    reasoning: str | None = None  # None | section | open
    spec: Any = None  # what the grammar compiles (a CFG, or the output type itself); None: free text
    parse_output: Any = None  # the answer's text -> the output value; None: the text itself

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def output_is_text(self) -> bool:
        """Whether the result's output is the reply's text itself (free text, or a grammar's text)."""
        return self.spec is None or isinstance(self.spec, CFG)


@dataclass(slots=True)
class Reply:
    """A chat reply read back: the answer's text (before any calls), the thinking, the calls."""

    text: str = ""
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments": dict}


# ---- the plan: tools, choice, grammar -------------------------------------------------------------------------


def tools_of(tools: Any) -> tuple[Tool, ...]:
    """OpenAI tool definitions checked and compiled one by one; ValueError / SchemaError naming the tool."""
    if tools is None:
        return ()
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError('tools must be a list such as [{"type": "function", "function": {"name": ..}}]')
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools per call; {len(tools)} were given")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        out.append(_tool(tool, f"tools[{i}]"))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique; got {names}")
    return tuple(out)


def _tool(tool: Any, where: str) -> Tool:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise ValueError(f'{where} must be {{"type": "function", "function": {{"name": .., "parameters": ..}}}}')
    function = tool["function"]
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ValueError(f"{where}.function has keys {unknown} that tools do not take; remove them")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r:.80}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ValueError(f'{where}.function.parameters must be a JSON schema of an object ({{"type": "object", ..}})')
    try:
        # key order kept: it is the order the answer writes
        enforced = tool_calls.enforced_parameters(json.dumps(parameters))
    except SchemaError as error:
        raise SchemaError(f"{where}.function.parameters: {error}", keyword=error.keyword, path=error.path) from None
    definition = {"type": "function", "function": {k: v for k, v in function.items() if k != "strict"}}
    return Tool(name, definition, enforced)


def choice_of(tool_choice: Any, tools: tuple[Tool, ...]) -> str:
    """"none", "auto", "required" or the named tool's name (OpenAI's default: auto with tools, else none)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ..}}')
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none declared"
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({known}); name a declared tool")
        return name
    if tool_choice not in CHOICES:
        raise ValueError(f'tool_choice {tool_choice!r:.80} is not accepted; use "none", "auto", "required" or a named function')
    if tool_choice != "none" and not tools:
        raise ValueError(f'tool_choice "{tool_choice}" needs tools; pass tools=[..] or leave tool_choice out')
    return tool_choice


def plan(
    output_type: Any,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    tool_format: str = "json",
    reasoning: str | None = None,
) -> ChatPlan:
    """The plan of one chat call (the module docstring); raises before any work."""
    if not isinstance(parallel_tool_calls, bool):
        raise TypeError(f"parallel_tool_calls must be True or False, got {parallel_tool_calls!r}")
    declared = tools_of(tools)
    choice = choice_of(tool_choice, declared)
    base = ChatPlan(declared, choice, parallel_tool_calls, tool_format, reasoning)
    if base.calls_tools:
        if output_type is not None:
            raise ValueError(
                "an output type and tools that may be called cannot be combined: the answer is a tool "
                'call or free text; leave output_type out, or pass tool_choice="none"'
            )
        return replace(base, spec=CFG(tool_calls.with_thinking(reasoning, _calls(base), THINKING)))
    if output_type is None or reasoning is None:
        return replace(base, spec=output_type)  # the output type's own grammar, or free text
    answer, parse = tool_calls.output_rules(output_type)
    return replace(base, spec=CFG(tool_calls.with_thinking(reasoning, answer, THINKING)), parse_output=parse)


def _calls(plan: ChatPlan) -> str:
    """Lark rules `answer: ..` of the plan's tool calls: those the choice allows."""
    tools = [(t.name, t.parameters) for t in plan.tools if plan.choice in ("auto", "required", t.name)]
    return tool_calls.call_rules(tools, plan.choice == "auto", plan.parallel, plan.tool_format)


# ---- messages with tool calls -----------------------------------------------------------------------------------


def split_tool_fields(messages: Any) -> tuple[Any, list[tuple[tuple[ToolCall, ...], str | None]]]:
    """The messages without their tool fields (what `skills.conversation` reads), and each message's
    (tool calls, tool_call_id); ValueError for a tool message that answers no earlier call."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        return messages, []  # skills.conversation says what a conversation is
    plain, fields = [], []
    called: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return messages, []
        message = dict(message)
        calls = _calls_of(message.pop("tool_calls", None), f"messages[{i}]", message.get("role"))
        call_id = message.pop("tool_call_id", None)
        if message.get("role") == "tool":
            if not isinstance(call_id, str) or call_id not in called:
                raise ValueError(
                    f"messages[{i}] is a tool result whose tool_call_id {call_id!r:.80} answers no earlier "
                    "assistant tool call; give each tool message the id of the call it answers"
                )
        elif call_id is not None:
            raise ValueError(f"messages[{i}]: tool_call_id belongs to tool messages only; remove it")
        if calls and message.get("content") is None:
            message["content"] = ""
        called.update(c.id for c in calls)
        plain.append(message)
        fields.append((calls, call_id))
    return plain, fields


def _calls_of(calls: Any, where: str, role: Any) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if role != "assistant":
        raise ValueError(f"{where}: tool_calls belong to assistant messages only")
    if isinstance(calls, str | bytes) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}.tool_calls must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        call_id = call.get("id") if isinstance(call, Mapping) else None
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise ValueError(
                f'{where}.tool_calls[{j}] must be {{"id": .., "type": "function", "function": {{"name": .., "arguments": ..}}}}'
            )
        assert isinstance(function, Mapping)  # the name was read from it
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object (as text)")
        out.append(ToolCall(call_id, name, json.dumps(parsed, ensure_ascii=False)))
    return tuple(out)


def attach_tool_fields(
    conversation: Conversation, fields: list[tuple[tuple[ToolCall, ...], str | None]], plan: ChatPlan
) -> Conversation:
    """`conversation` with each message's tool fields back, carrying the plan's tools for the template."""
    if fields:
        conversation = tuple(
            replace(m, tool_calls=calls, tool_call_id=call_id) for m, (calls, call_id) in zip(conversation, fields, strict=True)
        )
    return with_tools(conversation, [t.definition for t in plan.tools])


def plain_texts(plan: ChatPlan, conversation: Conversation) -> list[tuple[str, str]]:
    """(where, text) of every text a chat call puts in the prompt beside the messages' parts: tool
    definitions and earlier calls (checked by the family for special tokens, like message text)."""
    texts = [(f"tool {t.name!r}", json.dumps(t.definition, ensure_ascii=False)) for t in plan.tools]
    for message in conversation:
        texts += [("tool call", f"{c.id} {c.name} {c.arguments}") for c in message.tool_calls]
        if message.tool_call_id is not None:
            texts.append(("tool_call_id", message.tool_call_id))
    return texts


# ---- the reply read back -----------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyReader:
    """Reads a reply's text delta by delta into events (the module docstring): ("reasoning", text),
    ("content", text), and per tool call ("call_start", {"id", "name"}), ("call_arguments", text)
    pieces of its arguments' JSON as written (hermes: as they come; json format: whole, at the end),
    then ("tool_call", {"id", "name", "arguments": dict}). Text that could still be the start of a
    marker (`</think>`, `<tool_call>`, a call's closing text) is held back until the next delta
    decides it; `finish()` flushes what is left."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.buffer = ""
        self.state = {"section": "think_start", "open": "think"}.get(plan.reasoning or "", "answer_start")
        self.json_calls = plan.calls_tools and plan.tool_format == "json"
        self.call: dict = {}  # the hermes call being read: its id and name
        self.arguments = ""  # its arguments' text read so far

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self.buffer += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        """Steps until one changes nothing (the rest waits for the next delta, or is flushed when final)."""
        events: list[tuple[str, Any]] = []
        while True:
            before = (self.state, len(self.buffer))
            events += self._step(final=final)
            if (self.state, len(self.buffer)) == before:
                return events

    def _step(self, final: bool) -> list[tuple[str, Any]]:
        state, text = self.state, self.buffer
        if state == "think_start":
            if text.startswith(THINK_OPEN):
                self.buffer, self.state = text[len(THINK_OPEN) :], "think"
            elif final or not THINK_OPEN.startswith(text):
                self.state = "answer_start"  # no thinking section after all
            return []
        if state == "think":
            cut = text.find(THINK_CLOSE)
            if cut >= 0:
                self.buffer, self.state = text[cut + len(THINK_CLOSE) :], "after_think"
                return _event("reasoning", text[:cut])
            keep = 0 if final else _partial_suffix(text, THINK_CLOSE)
            self.buffer = text[len(text) - keep :]
            return _event("reasoning", text[: len(text) - keep])
        if state == "after_think":
            stripped = text.lstrip("\n")
            if stripped or final:
                self.buffer, self.state = stripped, "answer_start"
            else:
                self.buffer = ""
            return []
        if state == "answer_start":
            if self.json_calls:
                if not text and not final:
                    return []
                self.state = "json_calls" if text.startswith("{") else "answer"
            else:
                self.state = "answer"
            return []
        if state == "json_calls":
            if not final:
                return []
            self.buffer, self.state = "", "done"
            try:
                calls = json.loads(text)["tool_calls"]
            except (json.JSONDecodeError, KeyError, TypeError):  # cut by max_tokens: the text so far
                return _event("content", text)
            return [event for c in calls for event in _whole_call(c)]
        if state == "answer":
            if not (self.plan.calls_tools and self.plan.tool_format == "hermes"):
                self.buffer = ""
                return _event("content", text)
            cut = text.find(_CALL_START)
            if cut >= 0:
                self.buffer, self.state = text[cut + len(_CALL_START) :], "hermes_call"
                return _event("content", text[:cut])
            keep = 0 if final else _partial_suffix(text, _CALL_START)
            self.buffer = text[len(text) - keep :]
            return _event("content", text[: len(text) - keep])
        if state == "hermes_call":  # the grammar fixes the head: {"name": "<name>", "arguments": ...}
            head = _CALL_HEAD.match(text)
            if head is None:
                return []
            self.call = {"id": new_call_id(), "name": head[1]}
            self.arguments, self.buffer, self.state = "", text[head.end() :], "hermes_arguments"
            return [("call_start", dict(self.call))]
        if state == "hermes_arguments":  # the arguments as written, up to the call's closing "}\n</tool_call>"
            cut = text.find(_CALL_END)
            if cut < 0:
                keep = len(text) if final else min(len(text), len(_CALL_END) + 1)
                piece, self.buffer = text[: len(text) - keep], text[len(text) - keep :]
                self.arguments += piece
                return _event("call_arguments", piece)
            piece = text[: cut - 1]  # without the call object's own "}"
            self.arguments += piece
            self.buffer, self.state = text[cut + len(_CALL_END) :], "between_calls"
            done = {**self.call, "arguments": json.loads(self.arguments)}
            return [*_event("call_arguments", piece), ("tool_call", done)]
        if state == "between_calls":
            nxt = "\n" + _CALL_START
            if text.startswith(nxt):
                self.buffer, self.state = text[len(nxt) :], "hermes_call"
            elif not final and nxt.startswith(text):
                return []
            else:
                self.buffer, self.state = "", "done"
            return []
        self.buffer = ""  # done: nothing the grammar allows follows the calls
        return []


def read_reply(plan: ChatPlan, text: str) -> Reply:
    """The whole reply's fields (`ReplyReader` over one delta)."""
    reader = ReplyReader(plan)
    reply = Reply(reasoning="" if plan.reasoning else None)
    for kind, value in reader.feed(text) + reader.finish():
        if kind == "reasoning":
            reply.reasoning = (reply.reasoning or "") + value
        elif kind == "content":
            reply.text += value
        elif kind == "tool_call":
            reply.tool_calls.append(value)
    if reply.reasoning is not None:
        reply.reasoning = reply.reasoning.strip("\n")
    return reply


def _event(kind: str, text: str) -> list[tuple[str, Any]]:
    return [(kind, text)] if text else []


def _whole_call(call: dict) -> list[tuple[str, Any]]:
    """The events of a call read whole (foveal's JSON format): its start, its arguments, its end."""
    done = {"id": new_call_id(), "name": call["name"], "arguments": call["arguments"]}
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return [("call_start", {"id": done["id"], "name": done["name"]}), ("call_arguments", arguments), ("tool_call", done)]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (what must wait for the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---- streams ------------------------------------------------------------------------------------------------------


class LogprobsSoFar:
    """The logprobs of a streamed chat reply's committed tokens, in OpenAI's form (`token_logprobs`),
    read from its request's handle (`follow` is given the handle once the request is submitted)."""

    def __init__(self, read: Any, tokenizer: Any) -> None:
        self._read = read  # RequestHandle.logprobs, or None until `follow`
        self._tokenizer = tokenizer
        self._done: list[dict] = []

    def follow(self, handle: Any) -> None:
        self._read = handle.logprobs

    def __call__(self, start: int = 0) -> list[dict]:
        """The entries from the `start`-th on (a stream's reader asks only for the new ones)."""
        if self._read is not None:
            new = self._read(len(self._done))  # converted once each
            if new:
                self._done += token_logprobs(new, self._tokenizer)
        return self._done[start:]


class ChatTextStream(TextStream):
    """A chat call's `TextStream` of the raw reply, with its plan (what `ReplyReader` reads) and the
    logprobs of the tokens committed so far (`logprobs()`: OpenAI's entries, when asked for)."""

    __slots__ = ("logprobs", "plan")

    def __init__(self, chunks: Any, plan: ChatPlan, logprobs: LogprobsSoFar) -> None:
        super().__init__(chunks)
        self.plan = plan
        self.logprobs = logprobs


class AsyncChatStream(AsyncTextStream):
    """`ChatTextStream` for `achat`."""

    __slots__ = ("logprobs", "plan")

    def __init__(self, chunks: Any, plan: ChatPlan, logprobs: LogprobsSoFar) -> None:
        super().__init__(chunks)
        self.plan = plan
        self.logprobs = logprobs


# ---- logprobs -----------------------------------------------------------------------------------------------------


def token_logprobs(logprobs: Sequence[Any], tokenizer: Any) -> list[dict]:
    """OpenAI's `logprobs.content` of the engine's TokenLogprobs: token text, logprob, the token's own
    bytes (a token may hold part of a UTF-8 character) and the top alternatives (each the same fields).
    Log-probabilities are of the distribution the token was sampled from, after the grammar's mask
    (engine.request.TokenLogprob)."""
    try:
        known = tokenizer_handle(tokenizer).token_bytes()
    except ValueError:  # a tokenizer without an EOS: the tokenizer's own texts
        known = []
    cache: dict[int, dict] = {}

    def token(token_id: int) -> dict:
        if token_id not in cache:
            raw = known[token_id] if 0 <= token_id < len(known) else b""
            if raw:
                cache[token_id] = {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}
            else:  # a special token (or no byte table): its text, as the tokenizer names it
                text = tokenizer.convert_ids_to_tokens(token_id) or ""
                cache[token_id] = {"token": text, "bytes": list(text.encode("utf-8"))}
        return cache[token_id]

    out = []
    for entry in logprobs:
        top = [{**token(i), "logprob": _finite(lp)} for i, lp in entry.top]
        out.append({**token(entry.token_id), "logprob": _finite(entry.logprob), "top_logprobs": top})
    return out


def _finite(value: float) -> float:
    """JSON has no NaN or -inf: a value the engine could not give (a non-token step) is written as -9999.0,
    OpenAI's convention for 'very unlikely'."""
    return value if value == value and value != float("-inf") else -9999.0
