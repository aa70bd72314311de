"""Evaluate a shapes model as agents talk to it: `python -m foveal.training.eval_chat [--n 100] [--json out.json]`.

Through the SDK (`foveal.load(folder)`, the project's engine and grammars, greedy), on held-out
scenes (`eval_shapes.eval_scene`: seeds below training's), one case of each kind per scene:
- follow-up: "how many <a>?" answered correctly, then "and how many <b>?": exact count;
- system prompt: a system message, then a question of the scene (eval_shapes' rotation): exact;
- second image: an image and a question in turn 1, another image and a count question in turn 2:
  exact count of the second image;
- tool arguments: tools `count_shapes(colour, shape)` (plain strings, no enum) beside an unrelated
  one, tool_choice "auto", "how many <colour> <shape>s are there?": a call of count_shapes with
  exactly those arguments; `called` counts any call of count_shapes;
- tool relay: the call made and its result given (a number other than the scene's count): the
  answer is that number; `output_tool_relay`: the same with an output tool beside it
  (`final_result(shape, count)`, as pydantic-ai declares an output type) and tool_choice
  "required": final_result is called with that number as its count;
- no tool needed: a question that is not a count, tools offered, tool_choice "auto": a text answer;
- open JSON: generate(image, "describe the scene", {"type": "object"}): finished (not cut at
  max_tokens) and a JSON object; its token count; and a pydantic-like schema {shape: str, count:
  int} (required): finished and valid.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from foveal.training.chat_data import count_answer
from foveal.training.eval_shapes import DEFAULT_MODEL, eval_scene, eval_tasks
from foveal.vision import scenes

COUNT_TOOL = {
    "type": "function",
    "function": {
        "name": "count_shapes",
        "description": "Count the shapes of one colour and one kind in the image",
        "parameters": {
            "type": "object",
            "properties": {"colour": {"type": "string"}, "shape": {"type": "string"}},
            "required": ["colour", "shape"],
        },
    },
}
OTHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SHAPE_COUNT = {
    "type": "object",
    "properties": {"shape": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["shape", "count"],
}


def user(image, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def evaluate(model, n: int, seed_offset: int = 0) -> dict:
    hits: dict[str, list[float]] = {
        k: []
        for k in (
            "follow_up",
            "system_prompt",
            "second_image",
            "tool_called",
            "tool_arguments",
            "tool_relay",
            "output_tool_relay",
            "no_tool_needed_text",
            "json_object_finished",
            "json_schema_valid",
        )
    }
    json_tokens: list[int] = []
    for i in range(n):
        seed = seed_offset + i
        scene, other = eval_scene(seed), eval_scene(seed + 500_000)
        image, second = scenes.render(scene), scenes.render(other)
        rng = np.random.default_rng([seed, 7])
        nouns = [q[len("how many ") : -1] for q, _ in scenes.questions(scene)["count"]]
        a, b = (nouns[int(j)] for j in rng.choice(len(nouns), 2, replace=False))
        talk = [user(image, f"how many {a}?"), {"role": "assistant", "content": count_answer(scene, a)}]
        answer = model.chat([*talk, {"role": "user", "content": f"and how many {b}?"}])["text"]
        hits["follow_up"].append(answer.strip() == count_answer(scene, b))

        task = eval_tasks(scene, i)
        system = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
        answer = model.chat([system, user(image, task["question"])])["text"]
        hits["system_prompt"].append(answer.strip() == task["answer"])

        nouns2 = [q[len("how many ") : -1] for q, _ in scenes.questions(other)["count"]]
        c = nouns2[int(rng.integers(len(nouns2)))]
        first = [user(image, task["question"]), {"role": "assistant", "content": task["answer"]}]
        answer = model.chat([*first, user(second, f"how many {c}?")])["text"]
        hits["second_image"].append(answer.strip() == count_answer(other, c))

        obj = scene.objects[int(rng.integers(len(scene.objects)))]
        ask = user(image, f"how many {obj.colour} {obj.shape}s are there?")
        reply = model.chat([ask], tools=[OTHER_TOOL, COUNT_TOOL], tool_choice="auto")
        calls = [c for c in reply.get("tool_calls") or [] if c["name"] == "count_shapes"]
        hits["tool_called"].append(bool(calls))
        args = calls[0]["arguments"] if calls else None
        hits["tool_arguments"].append(args == {"colour": obj.colour, "shape": obj.shape})

        truth = int(count_answer(scene, f"{obj.colour} {obj.shape}s"))
        result = (truth + 1 + int(rng.integers(0, 9))) % 13
        call = {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "count_shapes",
                "arguments": json.dumps({"colour": obj.colour, "shape": obj.shape}),
            },
        }
        relay = [
            ask,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": str(result)},
        ]
        answer = model.chat(relay, tools=[OTHER_TOOL, COUNT_TOOL])["text"]
        hits["tool_relay"].append(answer.strip() == str(result))

        final = {
            "type": "function",
            "function": {
                "name": "final_result",
                "description": "The final response which ends this conversation",
                "parameters": SHAPE_COUNT,
            },
        }
        reply = model.chat(relay, tools=[COUNT_TOOL, final], tool_choice="required")
        outs = [c["arguments"] for c in reply.get("tool_calls") or [] if c["name"] == "final_result"]
        hits["output_tool_relay"].append(bool(outs) and outs[0].get("count") == result)

        other_question = task["question"] if not task["question"].startswith("how many") else "what do you see?"
        reply = model.chat([user(image, other_question)], tools=[OTHER_TOOL, COUNT_TOOL], tool_choice="auto")
        hits["no_tool_needed_text"].append(not reply.get("tool_calls") and bool(reply["text"].strip()))

        hits["json_object_finished"].append(_finished(model, image, {"type": "object"}, json_tokens))
        hits["json_schema_valid"].append(_finished(model, image, SHAPE_COUNT, None))
    out: dict[str, float | None] = {k: round(float(np.mean(v)), 3) for k, v in hits.items()}
    out["json_object_tokens_mean"] = round(float(np.mean(json_tokens)), 1) if json_tokens else None
    out["json_object_tokens_max"] = max(json_tokens) if json_tokens else None
    out["n"] = n
    return out


def _finished(model, image, schema: dict, tokens: list[int] | None) -> bool:
    """Whether generate under `schema` ends before max_tokens with an object the schema accepts."""
    import jsonschema

    from foveal import IncompleteOutputError

    try:
        result = model.generate(image, "describe the scene", schema, settings={"max_tokens": 200})
    except IncompleteOutputError:
        return False
    if tokens is not None:
        tokens.append(len(model.family.tokenizer(result["text"], add_special_tokens=False)["input_ids"]))
    try:
        jsonschema.validate(result["output"], schema)
    except jsonschema.ValidationError:
        return False
    return isinstance(result["output"], dict)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m foveal.training.eval_chat", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face folder of a shapes model")
    p.add_argument("--n", type=int, default=100, help="number of held-out scenes")
    p.add_argument("--seed-offset", type=int, default=0, help="first held-out scene seed")
    p.add_argument("--json", default=None, help="write the metrics here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    import foveal

    t0 = time.time()
    with foveal.load(args.model, device="cpu") as model:
        metrics = evaluate(model, args.n, args.seed_offset)
    metrics.update(model=str(args.model), seconds=round(time.time() - t0, 1))
    width = max(map(len, metrics))
    for key, value in metrics.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
