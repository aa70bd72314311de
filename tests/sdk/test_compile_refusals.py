"""Output types the grammar cannot decode as written, through the SDK on the embedded model (`foveal.load()`).

`generate(..., output_type=...)` refuses before decoding (SchemaError, the server's 422) a number the
grammar would approximate, and answers a number it holds with exactly the schema's value
(grammars/exact_numbers.py); it refuses a grammar that names a token directly
(grammars/special_tokens.py), which failed in the engine after decoding (GenerationError, a 500)."""

from __future__ import annotations

import typing
from pathlib import Path

import pydantic
import pytest

import foveal
from foveal.vision import scenes

EMBEDDED = Path(foveal.__file__).parent / "embedded"
pytestmark = pytest.mark.skipif(not (EMBEDDED / "model.safetensors").is_file(), reason="no embedded weights")


class LiteralInt(pydantic.BaseModel):
    x: typing.Literal[9007199254740993]


class LiteralFloat(pydantic.BaseModel):
    x: typing.Literal[0.9043986330300443]


class ExactLiterals(pydantic.BaseModel):
    x: typing.Literal[1152921504606846976]  # 2**60: beyond 2**53, held by a double
    y: typing.Literal[0.30000000000000004]


@pytest.fixture(scope="module")
def model():
    return foveal.load()


@pytest.fixture(scope="module")
def image():
    return scenes.render(scenes.generate_scene(seed=0, width=64))


@pytest.mark.parametrize(
    "output_type",
    [
        {"enum": [9007199254740993]},
        {"const": 2**64 + 1},
        {"const": 0.9043986330300443},
        LiteralInt,
        LiteralFloat,
    ],
    ids=["enum 2**53+1", "const 2**64+1", "const 17-digit float", "Literal int", "Literal float"],
)
def test_an_inexact_number_is_refused_before_decoding(model, image, output_type):
    with pytest.raises(foveal.SchemaError, match="cannot be enforced exactly"):
        model.generate(image, "which number?", output_type)


@pytest.mark.parametrize("value", [9007199254740992, 2**60, 2**63 - 1, 0.30000000000000004, 1e-300], ids=repr)
def test_an_exact_number_is_answered_exactly(model, image, value):
    assert model.generate(image, "which number?", {"enum": [value]})["output"] == value
    assert model.generate(image, "which number?", {"const": value})["output"] == value


def test_a_pydantic_literal_is_answered_exactly(model, image):
    output = model.generate(image, "which numbers?", ExactLiterals)["output"]
    assert (output.x, output.y) == (2**60, 0.30000000000000004)
    assert model.generate(image, "which?", typing.Literal[9007199254740993])["output"] == 9007199254740993


@pytest.mark.parametrize(
    "grammar", ['start: "a" <eos>', "start: <eos>", 'start: "a" <bos>', 'start: "a" <[1]>']
)
def test_a_grammar_naming_a_token_is_refused_before_decoding(model, image, grammar):
    with pytest.raises(foveal.SchemaError, match="names a token directly"):
        model.generate(image, "x", foveal.CFG(grammar))
    assert model.generate(image, "x", foveal.CFG('start: "a" | "b"'))["output"] in (
        "a",
        "b",
    )  # the engine still serves
