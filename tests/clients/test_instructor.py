"""instructor, unchanged, in its default mode (TOOLS: the response model as a forced function call),
against `foveal serve` with no `--model`: a pydantic response_model comes back filled.

instructor pins jiter<0.15, which holds the openai client at 3.3 (newer ones need jiter>=0.16), so it
has its own environment (`.ci/run` makes it): the default suite, on the newest openai client, skips
this file. Run it as .ci/run does:

    python3 -m venv /tmp/foveal-instructor && /tmp/foveal-instructor/bin/pip install -c constraints.txt -e ".[serve]" pytest instructor
    /tmp/foveal-instructor/bin/python -m pytest -q tests/clients/test_instructor.py
"""

from __future__ import annotations

import pytest

from tests.clients.conftest import Shape, scene, user

RUN_ME = (
    "instructor is not installed here (it holds openai at 3.3, so it has its own environment); run "
    "`bash .ci/run` or see tests/clients/test_instructor.py's docstring for its two commands"
)
instructor = pytest.importorskip("instructor", reason=RUN_ME)
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(base_url):
    return instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0))


def test_the_default_mode_is_tools(client):
    assert client.mode == instructor.Mode.TOOLS


def test_a_response_model_comes_back_filled(client):
    seed = 11
    shape = client.chat.completions.create(
        model="foveal",
        response_model=Shape,
        messages=[user("describe the main shape", seed)],
        max_tokens=200,
    )
    assert isinstance(shape, Shape)
    assert shape.shape in {o.shape for o in scene(seed).objects}


def test_a_counting_answer_is_the_scenes_count(client):
    seed = 13
    obj = scene(seed).objects[0]
    shape = client.chat.completions.create(
        model="foveal",
        response_model=Shape,
        messages=[{"role": "system", "content": "Answer briefly."}, user(f"how many {obj.shape}s?", seed)],
        max_tokens=200,
    )
    assert shape.shape == obj.shape
    assert shape.count == sum(o.shape == obj.shape for o in scene(seed).objects)
