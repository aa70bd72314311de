"""Fixtures of the client tests: `foveal serve` with no `--model` (the embedded shapes model) on a free
loopback port, once per module, and what the tests ask it about: scenes of its world as data URLs,
a counting tool, and the scenes' true answers.

Each test module drives one real library from the package index (openai, instructor, pydantic-ai,
langchain-openai, litellm) unchanged, pointed at the server, and asserts what a user of that library
gets: a tool call naming the tool with arguments valid against its schema and matching the question,
a parsed pydantic object, an agent run that calls its tool and returns its output type.

FOVEAL_CLIENTS_MODEL=/path/to/folder serves that folder instead of the embedded model (for trying
retrained weights before they ship in sdk/embedded); unset, the tests test what users get.
"""

from __future__ import annotations

import base64
import io
import json
import os

import jsonschema
import pytest
from pydantic import BaseModel

import foveal
from foveal.server import create_app
from foveal.server.background import BackgroundServer
from foveal.vision import scenes

# Nothing leaves the machine: litellm otherwise fetches its model-cost map from the network at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

COUNT_SHAPES = {
    "type": "function",
    "function": {
        "name": "count_shapes",
        "description": "Count the shapes of a colour and kind in the image",
        "parameters": {
            "type": "object",
            "properties": {
                "colour": {"type": "string", "description": "a colour"},
                "shape": {"type": "string", "description": "a shape"},
            },
            "required": ["colour", "shape"],
        },
    },
}
# What the tests give back as the tool's result: a number that is no count in the scenes asked about,
# so an answer that holds it relays the result instead of reading the image.
TOOL_RESULT = 7


class Shape(BaseModel):
    """The issue's small pydantic class: unbounded fields, nothing the schema could end for the model."""

    shape: str
    count: int


@pytest.fixture(scope="module")
def server():
    """The URL of a real server over the default model (no `--model`), started once per module."""
    folder = os.environ.get("FOVEAL_CLIENTS_MODEL")
    model = foveal.load(folder, device="cpu") if folder else foveal.load(device="cpu")
    try:
        with BackgroundServer(create_app(model)) as url:
            yield url
    finally:
        model.close()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    """What every client is given as its OpenAI base URL."""
    return f"{server}/v1"


def scene(seed: int) -> scenes.Scene:
    return scenes.generate_scene(seed, width=160)


def data_url(seed: int) -> str:
    """Scene `seed` as an OpenAI image_url data URL (PNG)."""
    buffer = io.BytesIO()
    scenes.render(scene(seed)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed)}}


def user(text: str, seed: int | None = None) -> dict:
    """A user turn: the scene's image (when given) then the text, as OpenAI's content parts."""
    parts = [image_part(seed)] if seed is not None else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def count(seed: int, noun: str) -> int:
    """The scene's true answer to 'how many <noun>?' ('red circles', 'squares', 'shapes')."""
    for question, answer in scenes.questions(scene(seed))["count"]:
        if question == f"how many {noun}?":
            return int(answer)
    raise ValueError(f"scene {seed} has no count question about {noun!r}")


def present(seed: int) -> scenes.SceneObject:
    """The first object of the scene: a colour and shape worth asking the counting tool about."""
    return scene(seed).objects[0]


def check_count_call(name: str, arguments: dict | str, obj: scenes.SceneObject) -> dict:
    """A call of count_shapes whose arguments are valid against its schema and name what was asked."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "count_shapes"
    jsonschema.validate(args, COUNT_SHAPES["function"]["parameters"])
    assert args == {"colour": obj.colour, "shape": obj.shape}, f"asked about {obj.colour} {obj.shape}s"
    return args
