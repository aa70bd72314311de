"""Conversations, tool calls and JSON answers about shape scenes: the embedded model's chat data.

PROBLEM
    Agent frameworks talk to a model in conversations (a system prompt, follow-up questions, images
    in several turns), hand it tools and feed the tools' results back, and ask for JSON objects whose
    fields they name. A model trained only on one-turn task prefixes refuses or garbles all of it.
SOLUTION
    Examples are foveal `Conversation`s (the messages the SDK builds from a caller's, tools attached
    with `with_tools`) rendered by the model's own chat template (`families.shapes.format`), so the
    training prompt is exactly the prompt `model.chat` sends. Four kinds, each drawn from the
    scenes' own questions and captions (`foveal.vision.scenes`):
      conversation  an optional system prompt, earlier turns answered correctly, then a question
                    about the latest image: a follow-up ("and how many squares?"), a new question,
                    or a question about a second image given in a later turn;
      tool call     tools as OpenAI definitions (a counting tool under varied names and parameter
                    names, with or without enums, beside unrelated tools): a counting question is
                    answered with the call, in the Hermes form the tool grammar constrains; any
                    other question is answered in text;
      tool result   the call made and its result given (any number, not the scene's): the answer is
                    the result;
      follow_up     (drawn only where a config asks for it) a count question answered, then an
                    elliptic one about the same image;
      answer_tool   (where a config asks for it) a tool whose parameters are the answer's fields,
                    as agents declare their output type (pydantic-ai's final_result, instructor's
                    and langchain's tool named after the class): called with the fields' values
                    about the scene, or, after a counting tool's result, with that result;
      json          the system line JSON_INSTRUCTION and a JSON object of a few fields about the
                    scene (field names from a pool, some unknown words), or a question's answer as
                    its one field, closed at once.
INVARIANTS (tests/training/test_chat_data.py)
    - Every tool-call target parses as a call of a declared tool whose arguments hold the tool's
      required parameters, spelled as `sdk.tools`' grammar writes them.
    - Every JSON target is a JSON object, and its text is json.dumps' (foveal's JSON separators).
    - Targets never hold location or segmentation tokens; answers are about the latest image.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from foveal.families.conversation import Conversation, Message, ToolCall, with_tools
from foveal.families.shapes.format import JSON_INSTRUCTION
from foveal.vision import scenes

KINDS = ("conversation", "tool_call", "tool_result", "json", "follow_up", "answer_tool")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant that answers questions about images.",
    "Answer briefly.",
    "Answer in a few words.",
    "You look at pictures of shapes and answer questions about them.",
    "Be concise and accurate.",
    "You are a vision assistant.",
)
CAPTION_ASKS = {
    "short": ("describe the image briefly", "what is in the image?", "summarize the picture"),
    "normal": ("describe the image", "what do you see?", "describe this picture"),
    "long": ("describe the image in detail", "describe every shape and where it is"),
}
# Counting tools as agents declare them: (name, description, colour parameter or None, shape parameter).
COUNT_TOOLS = (
    ("count_shapes", "Count the shapes of a colour and kind in the image", "colour", "shape"),
    ("count_objects", "Count objects by color and shape", "color", "shape"),
    ("count", "How many shapes of this colour and type there are", "colour", "type"),
    ("shape_count", "Number of shapes matching a colour and a kind", "colour", "kind"),
    ("tally", "Tally the objects of one colour and shape", "color", "kind"),
    ("count_kind", "Count the shapes of one kind", None, "shape"),
    ("how_many", "How many objects of a shape are in the picture", None, "object"),
)
OTHER_TOOLS = (
    ("get_weather", "Current weather in a city", ("city",)),
    ("send_email", "Send an email", ("to", "subject", "body")),
    ("search_web", "Search the web", ("query",)),
    ("get_time", "The current time in a time zone", ("timezone",)),
    ("add", "Add two numbers", ("a", "b")),
)
RESULT_FORMATS = ("{n}", '{{"count": {n}}}', "count: {n}", "{n} found", '{{"result": {n}}}')
JSON_KEYS = {
    "shapes": "shapes",
    "colours": "colours",
    "colors": "colours",
    "count": "count",
    "total": "count",
    "number": "count",
    "shape": "shape",
    "kind": "shape",
    "colour": "colour",
    "color": "colour",
    "objects": "objects",
    "caption": "caption",
    "description": "caption",
    "summary": "caption",
}
OTHER_KEYS = ("name", "label", "answer", "value", "item", "main", "scene", "object", "result", "thing")
JSON_ASKS = (
    "describe the scene",
    "describe the image",
    "what is in the image?",
    "list the shapes",
    "how many shapes are there?",
    "which colours are there?",
    "extract the shapes",
    "give me the details",
)
COUNT_QUESTION = re.compile(r"^how many (.+)\?$")


@dataclass(slots=True)
class ChatExample:
    """One conversation (tools attached), its scenes in image order, the assistant's target answer."""

    conversation: Conversation
    images: list[scenes.Scene]
    target: str
    kind: str


KIND_WEIGHTS = {"conversation": 0.35, "tool_call": 0.25, "tool_result": 0.15, "json": 0.25}


def sample_chat(
    rng: np.random.Generator, new_scene, kind: str | None = None, weights: dict[str, float] | None = None
) -> ChatExample:
    """An example of `kind` (drawn by `weights` over KINDS when None); `new_scene(rng)` draws one
    training scene."""
    if kind is None:
        shares = np.array([(weights or KIND_WEIGHTS).get(k, 0.0) for k in KINDS])
        kind = KINDS[int(rng.choice(len(KINDS), p=shares / shares.sum()))]
    return {
        "conversation": conversation_example,
        "tool_call": tool_call_example,
        "tool_result": tool_result_example,
        "json": json_example,
        "follow_up": follow_up_example,
        "answer_tool": answer_tool_example,
    }[kind](rng, new_scene)


# ---- conversations ---------------------------------------------------------------------------------------------


def conversation_example(rng: np.random.Generator, new_scene) -> ChatExample:
    images = [new_scene(rng)]
    asks: list[tuple[int | None, str, str]] = [(0, *_ask(rng, images[0]))]  # (the image shown with this turn or None, question, answer)
    for _ in range(int(rng.integers(0, 3))):  # later turns; the earlier ones answered correctly
        if rng.random() < 0.3 and len(images) < 3:
            images.append(new_scene(rng))
            asks.append((len(images) - 1, *_ask(rng, images[-1])))
        else:
            asks.append((None, *_follow_up(rng, images[-1], asks[-1][1])))
    turns = _system(rng, 0.5)
    for image, question, answer in asks:
        parts = (question,) if image is None else (image, question)
        turns += [Message("user", parts), Message("assistant", (answer,))]
    return ChatExample(tuple(turns[:-1]), images, asks[-1][2], "conversation")


def follow_up_example(rng: np.random.Generator, new_scene) -> ChatExample:
    """A count question answered, then an elliptic one about the same image ("and how many squares?")."""
    scene = new_scene(rng)
    first = _count_noun(rng, scene)
    question = f"how many {first}?"
    turns = [*_system(rng, 0.5), Message("user", (0, question)), Message("assistant", (count_answer(scene, first),))]
    follow, answer = _follow_up(rng, scene, question)
    while not follow.startswith(("and ", "what about ", "how about ")):
        follow, answer = _follow_up(rng, scene, question)
    return ChatExample((*turns, Message("user", (follow,))), [scene], answer, "follow_up")


def _system(rng: np.random.Generator, p: float) -> list[Message]:
    if rng.random() >= p:
        return []
    return [Message("system", (SYSTEM_PROMPTS[int(rng.integers(len(SYSTEM_PROMPTS)))],))]


def _ask(rng: np.random.Generator, scene: scenes.Scene) -> tuple[str, str]:
    """A question about the scene and its answer: one of its questions, or a caption request."""
    if rng.random() < 0.2:
        length = ("short", "normal", "long")[int(rng.integers(3))]
        asks = CAPTION_ASKS[length]
        return asks[int(rng.integers(len(asks)))], scenes.caption(scene, length)
    pairs = scenes.questions(scene)
    kinds = [k for k, v in pairs.items() if v]
    options = pairs[kinds[int(rng.integers(len(kinds)))]]
    present = [(q, a) for q, a in options if a != "0"]
    if present and rng.random() < 0.6:
        options = present
    return options[int(rng.integers(len(options)))]


def _follow_up(rng: np.random.Generator, scene: scenes.Scene, previous: str) -> tuple[str, str]:
    """After a count question, an elliptic one ("and how many squares?"); else a new question."""
    if COUNT_QUESTION.match(previous) and rng.random() < 0.7:
        noun = _count_noun(rng, scene)
        form = ("and how many {}?", "what about {}?", "and {}?", "how about {}?")[int(rng.integers(4))]
        return form.format(noun), count_answer(scene, noun)
    return _ask(rng, scene)


def _count_noun(rng: np.random.Generator, scene: scenes.Scene) -> str:
    nouns = [m[1] for q, _ in scenes.questions(scene)["count"] if (m := COUNT_QUESTION.match(q))]
    present = [n for n in nouns if count_answer(scene, n) != "0"]
    pool = present if present and rng.random() < 0.7 else nouns
    return pool[int(rng.integers(len(pool)))]


def count_answer(scene: scenes.Scene, noun: str) -> str:
    """The scene's answer to 'how many <noun>?' (the count questions' own answer)."""
    for q, a in scenes.questions(scene)["count"]:
        if q == f"how many {noun}?":
            return a
    raise ValueError(f"no count question about {noun!r}")


# ---- tools ------------------------------------------------------------------------------------------------------


def tool_definitions(rng: np.random.Generator) -> tuple[list[dict], tuple]:
    """Tools as an agent declares them: a counting tool among 0-2 others, in random order."""
    spec = COUNT_TOOLS[int(rng.integers(len(COUNT_TOOLS)))]
    enums = rng.random() < 0.5
    tools = [_count_tool(spec, enums)]
    for i in rng.permutation(len(OTHER_TOOLS))[: int(rng.integers(0, 3))]:
        name, description, params = OTHER_TOOLS[int(i)]
        tools.append(_function(name, description, {p: {"type": "string"} for p in params}, list(params)))
    order = rng.permutation(len(tools))
    return [tools[int(i)] for i in order], spec


def _count_tool(spec: tuple, enums: bool) -> dict:
    name, description, colour, shape = spec
    properties: dict = {}
    if colour is not None:
        properties[colour] = {"type": "string", "description": "a colour"}
        if enums:
            properties[colour]["enum"] = list(scenes.COLOURS)
    properties[shape] = {"type": "string", "description": "a shape"}
    if enums:
        properties[shape]["enum"] = list(scenes.SHAPES)
    return _function(name, description, properties, list(properties))


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def count_call(rng: np.random.Generator, scene: scenes.Scene, spec: tuple) -> tuple[str, dict]:
    """A counting question the tool answers, and the call's arguments (in its parameters' order)."""
    _, _, colour_param, shape_param = spec
    obj = scene.objects[int(rng.integers(len(scene.objects)))] if rng.random() < 0.7 else None
    shape = obj.shape if obj else scenes.SHAPES[int(rng.integers(len(scenes.SHAPES)))]
    colour = obj.colour if obj else list(scenes.COLOURS)[int(rng.integers(len(scenes.COLOURS)))]
    noun = f"{colour} {shape}s" if colour_param else f"{shape}s"
    form = ("how many {}?", "how many {} are there?", "count the {}", "how many {} do you see?")
    question = form[int(rng.integers(len(form)))].format(noun)
    arguments = {colour_param: colour, shape_param: shape} if colour_param else {shape_param: shape}
    return question, arguments


def hermes_call(name: str, arguments: dict) -> str:
    """A call as `sdk.tools` constrains it for a template that writes <tool_call> itself."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_call_example(rng: np.random.Generator, new_scene) -> ChatExample:
    scene = new_scene(rng)
    tools, spec = tool_definitions(rng)
    turns = _system(rng, 0.4)
    if rng.random() < 0.75:
        question, arguments = count_call(rng, scene, spec)
        target = hermes_call(spec[0], arguments)
    else:  # nothing to call: the question is answered in text
        question, target = _ask(rng, scene)
        while COUNT_QUESTION.match(question):
            question, target = _ask(rng, scene)
    turns.append(Message("user", (0, question)))
    return ChatExample(with_tools(tuple(turns), tools), [scene], target, "tool_call")


def tool_result_example(rng: np.random.Generator, new_scene) -> ChatExample:
    scene = new_scene(rng)
    tools, spec = tool_definitions(rng)
    question, arguments = count_call(rng, scene, spec)
    call_id = f"call_{int(rng.integers(10**6))}"
    n = int(rng.integers(0, 13))  # any number: the answer relays the tool's result, not the scene
    result = RESULT_FORMATS[int(rng.integers(len(RESULT_FORMATS)))].format(n=n)
    turns = [
        *_system(rng, 0.4),
        Message("user", (0, question)),
        Message("assistant", (), (ToolCall(call_id, spec[0], json.dumps(arguments)),)),
        Message("tool", (result,), (), call_id),
    ]
    return ChatExample(with_tools(tuple(turns), tools), [scene], str(n), "tool_result")


# ---- JSON -------------------------------------------------------------------------------------------------------


def json_example(rng: np.random.Generator, new_scene) -> ChatExample:
    scene = new_scene(rng)
    value = json_object(rng, scene, _distinct_keys(rng))
    if rng.random() < 0.5:
        ask = JSON_ASKS[int(rng.integers(len(JSON_ASKS)))]
    else:  # a question: its answer as the one field, or fields about the scene
        ask, answer = _ask(rng, scene)
        if rng.random() < 0.5:
            value = {("answer", "result", "value")[int(rng.integers(3))]: answer}
    turns = [Message("system", (JSON_INSTRUCTION,)), Message("user", (0, ask))]
    return ChatExample(tuple(turns), [scene], json.dumps(value), "json")


def json_object(rng: np.random.Generator, scene: scenes.Scene, keys: list[str]) -> dict:
    """A JSON object about the scene with these keys, each value what its name asks for."""
    objects = list(scene.objects)
    picked = objects[int(rng.integers(len(objects)))]
    out: dict = {}
    for key in keys:
        meaning = JSON_KEYS.get(key)
        if meaning == "shapes":
            out[key] = [o.shape for o in objects]
        elif meaning == "colours":
            out[key] = [o.colour for o in objects]
        elif meaning == "count":
            shape = out.get("shape") or out.get("kind")
            out[key] = sum(1 for o in objects if shape in (None, o.shape))
        elif meaning == "shape":
            out[key] = picked.shape
        elif meaning == "colour":
            out[key] = picked.colour
        elif meaning == "objects":
            out[key] = [{"colour": o.colour, "shape": o.shape} for o in objects]
        elif meaning == "caption":
            out[key] = scenes.caption(scene, "short")
        else:
            out[key] = picked.phrase()
    return out


# ---- answers as tool calls (agents' output types) ------------------------------------------------------------

OUTPUT_TOOLS = (
    ("final_result", "The final response which ends this conversation"),
    ("Shape", "Correctly extracted `Shape` with all the required parameters with correct types"),
    ("ShapeCount", ""),
    ("Answer", "Answer the user"),
    ("SceneInfo", "Correctly extracted `SceneInfo` with all the required parameters with correct types"),
    ("extract", "Extract the fields"),
)
FIELD_SCHEMAS = {
    "shapes": {"type": "array", "items": {"type": "string"}},
    "colours": {"type": "array", "items": {"type": "string"}},
    "count": {"type": "integer"},
    "objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"colour": {"type": "string"}, "shape": {"type": "string"}},
            "required": ["colour", "shape"],
        },
    },
}


def answer_tool_example(rng: np.random.Generator, new_scene) -> ChatExample:
    scene = new_scene(rng)
    name, description = OUTPUT_TOOLS[int(rng.integers(len(OUTPUT_TOOLS)))]
    relay = rng.random() < 0.4
    if relay:  # a counting tool was called and answered: the output carries its result
        tools, spec = tool_definitions(rng)
        question, arguments = count_call(rng, scene, spec)
        keys = [k for k in ("shape", "colour", "count") if k == "count" or rng.random() < 0.6]
    else:
        tools, spec = [], None
        keys = _answer_keys(rng)
        question, answer = JSON_ASKS[int(rng.integers(len(JSON_ASKS)))], None
        if rng.random() < 0.5:
            question, answer = _ask(rng, scene)
    properties = {k: FIELD_SCHEMAS.get(JSON_KEYS.get(k, k), {"type": "string"}) for k in keys}
    output = _function(name, description, properties, list(keys))
    turns: list[Message] = [*_system(rng, 0.4), Message("user", (0, question))]
    if relay:
        assert spec is not None  # set with relay above
        call_id = f"call_{int(rng.integers(10**6))}"
        n = int(rng.integers(0, 13))
        turns += [
            Message("assistant", (), (ToolCall(call_id, spec[0], json.dumps(arguments)),)),
            Message("tool", (RESULT_FORMATS[int(rng.integers(len(RESULT_FORMATS)))].format(n=n),), (), call_id),
        ]
        values = {"shape": arguments[spec[3]], "colour": arguments.get(spec[2]) if spec[2] else None, "count": n}
        value = {k: values[k] for k in keys if values[k] is not None}
        output = _function(name, description, {k: properties[k] for k in value}, list(value))
    else:
        value = json_object(rng, scene, keys)
        for key in ("answer", "result", "value"):  # a question's answer where a field asks for it
            if key in value and answer is not None:
                value[key] = answer
    every = [*tools, output]
    order = rng.permutation(len(every))
    return ChatExample(
        with_tools(tuple(turns), [every[int(i)] for i in order]), [scene], hermes_call(name, value), "answer_tool"
    )


def _distinct_keys(rng: np.random.Generator) -> list[str]:
    """One to three field names, no two meaning the same (colour and color, count and total)."""
    keys = list(JSON_KEYS) + list(OTHER_KEYS)
    chosen: list[str] = []
    for i in rng.permutation(len(keys))[: int(rng.integers(1, 4))]:
        key = keys[int(i)]
        if all(JSON_KEYS.get(k, k) != JSON_KEYS.get(key, key) for k in chosen):
            chosen.append(key)
    return chosen


def _answer_keys(rng: np.random.Generator) -> list[str]:
    chosen = _distinct_keys(rng)
    if "count" in chosen and "shape" not in chosen and rng.random() < 0.5:
        chosen.insert(0, "shape")  # Shape(shape, count): the count is of that shape
    return chosen

