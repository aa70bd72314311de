"""OpenAI's chat API against the real `openai` client: text, image parts, streams with usage,
structured output with `parse(response_format=PydanticModel)`, stop, limits, Bearer auth."""

from __future__ import annotations

from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from foveal.server import ServerConfig
from tests.server.conftest import all_pages_free, data_url, scene

openai = pytest.importorskip("openai")


class Count(BaseModel):
    shape: Literal["circle", "square", "triangle"]
    count: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def ask(question: str, image=None) -> list[dict]:
    parts = [{"type": "text", "text": question}]
    if image is not None:
        parts.append({"type": "image_url", "image_url": {"url": data_url(image)}})
    return [{"role": "user", "content": parts}]


def test_text_answer_is_the_sdk_chat(client, model):
    """The route answers what `model.chat` answers for the same messages (the model's chat template
    renders them; `query`'s task prefix is another prompt)."""
    image = scene(2)
    reply = client.chat.completions.create(model="foveal", messages=ask("how many squares?", image))
    choice = reply.choices[0]
    sdk_messages = [
        {"role": "user", "content": [{"type": "text", "text": "how many squares?"}, {"type": "image", "image": data_url_bytes(image)}]}
    ]
    assert choice.message.content == model.chat(sdk_messages)["text"]
    assert choice.finish_reason == "stop" and reply.object == "chat.completion"
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > reply.usage.completion_tokens


def test_stream_chunks_join_to_the_answer_and_carry_usage(client):
    image = scene(4)
    messages = ask("what colour is the circle?", image)
    whole = client.chat.completions.create(model="foveal", messages=messages).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="foveal", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_parse_with_a_pydantic_model(client, model):
    reply = client.chat.completions.parse(
        model="foveal",
        messages=ask("what shape is most common, and how many?", scene(6)),
        response_format=Count,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Count)
    assert all_pages_free(model)


def test_json_object_is_a_json_object(client):
    import json

    reply = client.chat.completions.create(
        model="foveal",
        messages=ask("describe", scene(1)),
        response_format={"type": "json_object"},
        max_completion_tokens=200,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max tokens: OpenAI's "length", the text so far
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_streamed_json_answer_frees_its_admission_slot(client, server):
    chunks = client.chat.completions.create(
        model="foveal",
        messages=ask("describe", scene(1)),
        response_format={"type": "json_object"},
        max_completion_tokens=30,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("{")
    assert "foveal_queue_depth 0" in httpx.get(f"{server}/metrics").text


def test_max_tokens_cuts_with_finish_reason_length(client):
    reply = client.chat.completions.create(
        model="foveal", messages=ask("describe the image", scene(7)), max_tokens=1
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 1


def test_stop_string_cuts_the_answer(random_server):
    """The random-weight model talks until max_tokens: a long text to cut."""
    client = openai.OpenAI(base_url=f"{random_server}/v1", api_key="unused", max_retries=0)
    messages = ask("describe", scene(8))
    whole = client.chat.completions.create(model="foveal", messages=messages, max_tokens=40)
    text = whole.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    expected = text[: text.index(stop)]
    reply = client.chat.completions.create(
        model="foveal", messages=messages, max_tokens=40, stop=[stop, "@@@@"]
    )
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < whole.usage.completion_tokens
    streamed = client.chat.completions.create(
        model="foveal", messages=messages, max_tokens=40, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_unsupported_requests_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="n=9"):  # above the documented limit (chat.MAX_CHOICES)
        client.chat.completions.create(model="foveal", messages=ask("hi", scene(0)), n=9)
    with pytest.raises(openai.BadRequestError, match="remote URLs are not fetched"):
        client.chat.completions.create(
            model="foveal",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
            ],
        )
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="foveal", messages=ask("hi", scene(0)), temperature=-1)


def test_models_and_bearer_auth(client, serve):
    assert [m.id for m in client.models.list()] == ["foveal"]
    url = serve(ServerConfig(api_key="sesame"))
    assert openai.OpenAI(base_url=f"{url}/v1", api_key="sesame").models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def data_url_bytes(image) -> bytes:
    import base64

    return base64.b64decode(data_url(image).split(",", 1)[1])
