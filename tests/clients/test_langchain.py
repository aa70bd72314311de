"""langchain's `ChatOpenAI`, unchanged, against `foveal serve` with no `--model`: `bind_tools` gives a
valid call of the tool, its result relayed in the next turn; `with_structured_output(Model)` gives
the pydantic object, by its default method (json_schema) and by function calling.
"""

from __future__ import annotations

import pytest

from tests.clients.conftest import TOOL_RESULT, Shape, check_count_call, data_url, present, scene

pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402


@tool
def count_shapes(colour: str, shape: str) -> int:
    """Count the shapes of a colour and kind in the image"""
    return TOOL_RESULT


@pytest.fixture(scope="module")
def llm(base_url):
    return ChatOpenAI(model="foveal", base_url=base_url, api_key="unused", max_retries=0, max_tokens=200)


def ask(text: str, seed: int) -> HumanMessage:
    return HumanMessage(
        content=[{"type": "image_url", "image_url": {"url": data_url(seed)}}, {"type": "text", "text": text}]
    )


def test_bind_tools_gives_a_valid_call_and_relays_its_result(llm):
    seed = 2
    obj = present(seed)
    question = ask(f"how many {obj.colour} {obj.shape}s?", seed)
    with_tools = llm.bind_tools([count_shapes])
    reply = with_tools.invoke([question])
    assert reply.tool_calls, reply.content
    call = reply.tool_calls[0]
    check_count_call(call["name"], call["args"], obj)
    result = count_shapes.invoke(call)  # a ToolMessage answering the call
    assert isinstance(result, ToolMessage)
    answer = with_tools.invoke([question, reply, result])  # the result goes back through langchain
    # What the model makes of the result is its accuracy (training/eval_chat.py: tool relay), not the
    # library's: langchain reads the reply back as text or as calls of the declared tool.
    assert answer.content.strip() or answer.tool_calls
    assert all(c["name"] == "count_shapes" and set(c["args"]) == {"colour", "shape"} for c in answer.tool_calls)


@pytest.mark.parametrize("method", [None, "function_calling"], ids=["default", "function_calling"])
def test_with_structured_output_gives_the_model(llm, method):
    seed = 11
    kwargs = {} if method is None else {"method": method}
    shape = llm.with_structured_output(Shape, **kwargs).invoke([ask("describe the main shape", seed)])
    assert isinstance(shape, Shape)
    assert shape.shape in {o.shape for o in scene(seed).objects}
