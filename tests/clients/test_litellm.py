"""litellm, unchanged, against `foveal serve` with no `--model`: `completion(model="openai/...",
api_base=..., tools=...)` gives a valid call of the tool (streamed too), and the tool's result is
relayed in the next turn. (conftest sets LITELLM_LOCAL_MODEL_COST_MAP so that its import stays offline.)
"""

from __future__ import annotations

import pytest

from tests.clients.conftest import COUNT_SHAPES, TOOL_RESULT, check_count_call, present, user

litellm = pytest.importorskip("litellm")


@pytest.fixture(scope="module")
def complete(base_url):
    def complete(**kwargs):
        return litellm.completion(
            model="openai/foveal", api_base=base_url, api_key="unused", max_tokens=200, **kwargs
        )

    return complete


def test_tools_give_a_valid_call_and_its_result_is_relayed(complete):
    seed = 3
    obj = present(seed)
    messages = [user(f"how many {obj.colour} {obj.shape}s?", seed)]
    reply = complete(messages=messages, tools=[COUNT_SHAPES])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    check_count_call(call.function.name, call.function.arguments, obj)
    follow_up = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(TOOL_RESULT)},
    ]
    answer = complete(messages=follow_up, tools=[COUNT_SHAPES]).choices[0]
    assert answer.finish_reason == "stop" and str(TOOL_RESULT) in answer.message.content


def test_a_streamed_call_is_valid(complete):
    seed = 4
    obj = present(seed)
    chunks = list(
        complete(
            messages=[user(f"how many {obj.colour} {obj.shape}s?", seed)],
            tools=[COUNT_SHAPES],
            tool_choice="required",
            stream=True,
        )
    )
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function.name == "count_shapes"
    check_count_call(deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas), obj)
