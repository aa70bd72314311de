"""A pydantic-ai agent, unchanged, with a tool and an output type, pointed at `foveal serve` (no
`--model`) through its OpenAI provider: the run calls the tool, gets its result and returns the
output type (pydantic-ai's default tool output: a `final_result` call, tool_choice required).
How often the embedded model's output carries the tool's result is measured by
`python -m foveal.training.eval_chat` (output_tool_relay), not asserted here.
"""

from __future__ import annotations

import pytest

from tests.clients.conftest import TOOL_RESULT, Shape, check_count_call, data_url, present

pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic_ai import Agent, ImageUrl  # noqa: E402
from pydantic_ai.messages import ToolReturnPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


@pytest.fixture(scope="module")
def model(base_url):
    return OpenAIChatModel("foveal", provider=OpenAIProvider(base_url=base_url, api_key="unused"))


def counting_agent(model, output_type, calls: list) -> Agent:
    agent = Agent(model, output_type=output_type)  # no max_tokens: what the context leaves

    @agent.tool_plain
    def count_shapes(colour: str, shape: str) -> int:
        """Count the shapes of a colour and kind in the image"""
        calls.append({"colour": colour, "shape": shape})
        return TOOL_RESULT

    return agent


def test_an_agent_calls_its_tool_and_returns_its_output_type(model):
    seed = 1
    obj = present(seed)
    calls: list[dict] = []
    agent = counting_agent(model, Shape, calls)
    result = agent.run_sync([f"how many {obj.colour} {obj.shape}s?", ImageUrl(url=data_url(seed))])
    assert calls, "the agent never called count_shapes"
    check_count_call("count_shapes", calls[0], obj)
    returns = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
    assert any(p.tool_name == "count_shapes" and p.content == TOOL_RESULT for p in returns)
    assert isinstance(result.output, Shape)  # final_result's call, valid by construction
    # Whether the output carries the tool's result is the model's accuracy (training/eval_chat.py:
    # output_tool_relay), not the library's or the API's.
    assert result.output.shape in {"circle", "square", "triangle"} and result.output.count >= 0


def test_an_agent_with_text_output_answers_in_text(model):
    seed = 0
    agent = Agent(model, system_prompt="Answer briefly.")
    result = agent.run_sync(["what color is the circle?", ImageUrl(url=data_url(seed))])
    assert result.output.strip() == "green"
