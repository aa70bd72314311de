"""Fuzz: random calls on the embedded model keep the SDK's contract (issue 13).

Each test draws calls from a seeded `random.Random`: a skill (caption, query, detect, point,
generate), an image (scenes of random sizes as PIL / array / PNG or JPEG bytes / path /
EncodedImage, and corrupt bytes, a PNG header claiming 10^10 pixels, arrays of the wrong dtype or
shape, missing files, None; now and then a list of them, the batch path), a phrase, question or prompt (ordinary words, empty, whitespace, very
long, newlines, unicode, the location format's separator " ; ", special-token text such as
`<loc0005>` and `<eos>`, non-strings), settings (valid and invalid values, unknown keys, wrong
types, seeds up to 2**64, max_tokens from 1 to past the context, max_objects) and, for generate,
an output type (pydantic models, JSON-schema dicts with bounds, enums, formats, nested objects and
arrays, Regex, CFG, Literal, Enum, choice lists, scalar types, dataclasses, and specs that must be
refused).

THE CONTRACT, checked for every call:
1. Either the call raises a documented exception *before any request reaches the engine* (no
   request accepted by `engine.submit`, seen by a spy): exactly ValueError, TypeError,
   foveal.SchemaError or foveal.ImageError, never a subclass from a library such as pydantic's
   ValidationError or json's JSONDecodeError, with a non-empty message;
2. or its request was accepted and it raises IncompleteOutputError (max_tokens cut a constrained
   answer), the one documented exception that comes after work;
3. or it returns a result of the skill's shape: caption/query a string, detect boxes with
   0 <= x_min < x_max <= 1 (and y alike), point points in [0, 1], at most max_objects of either;
   generate `{"text", "output"}` whose output its output type accepts (pydantic instance that
   re-validates, `jsonschema.validate` with format checks, `re.fullmatch` for Regex, the CFG's
   language, membership for Literal/Enum/choices, the exact scalar type).
Nothing else may escape. After every batch of calls the engine still serves (a known-good detect
answers as it did at the start); at the end it goes idle with every KV page free.

A list of images returns one entry per image, in order: a result of the skill's shape, or the
image's exception (one of the types above) in its place.
A violation is reported with the call that caused it, written as Python, so it can be rerun.
The default run draws 4 seeds x 25 calls and a 4-thread batch (about 20 s with the model load);
`-m slow` runs 20 more seeds of 60 calls and 4 threads of 50 (about 2 minutes).

What the fuzz found (added-token text in output types) is pinned below the fuzz tests as a regression
test, and kept out of the draws.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import io
import json
import math
import random
import re
import struct
import threading
import typing
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jsonschema
import numpy as np
import pydantic
import pytest
from PIL import Image

import foveal
from foveal.vision import scenes

EMBEDDED = Path(foveal.__file__).parent / "embedded"
pytestmark = pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(), reason="no weights in sdk/embedded"
)

SKILLS = ("caption", "query", "detect", "point", "generate")
PRE_WORK = (ValueError, TypeError, foveal.SchemaError, foveal.ImageError)  # exact types, before work
REFERENCE_PHRASE = "circle"


# ---- the model, a spy on the engine, and the known-good answer ---------------------------------------------------


class SubmitSpy:
    """Counts, per calling thread, the requests `engine.submit` accepted (a refused one raises)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.original = engine.submit
        self.counts: Counter[int] = Counter()
        self._lock = threading.Lock()
        engine.submit = self._submit

    def _submit(self, request: Any) -> Any:
        handle = self.original(request)
        with self._lock:
            self.counts[threading.get_ident()] += 1
        return handle

    def accepted(self) -> int:
        """Requests accepted so far from the calling thread."""
        with self._lock:
            return self.counts[threading.get_ident()]

    def restore(self) -> None:
        del self.engine.submit  # the instance attribute: the class's method shows through again


@pytest.fixture(scope="module")
def model():
    model = foveal.load()
    yield model
    model.close()


@pytest.fixture(scope="module")
def spy(model):
    spy = SubmitSpy(model.engine)
    yield spy
    spy.restore()


@pytest.fixture(scope="module")
def reference_image() -> Image.Image:
    return scenes.render(scenes.generate_scene(3, 64))


@pytest.fixture(scope="module")
def reference(model, reference_image) -> dict:
    """The known-good detect answer, taken before any fuzzing."""
    answer = model.detect(reference_image, REFERENCE_PHRASE)
    assert answer["objects"], "the reference scene should have a detected circle"
    return answer


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz_images")


# ---- output types: each with the check of what its output must be -----------------------------------------------


class Item(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=12)
    count: int = pydantic.Field(ge=0, le=9)


class Inventory(pydantic.BaseModel):
    kind: Literal["circle", "square", "triangle"]
    items: list[Item] = pydantic.Field(max_length=3)
    ok: bool
    note: str | None = None


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Size(enum.IntEnum):
    SMALL = 1
    LARGE = 2


@dataclasses.dataclass
class Spot:
    x: float
    y: float


class Loose(typing.TypedDict):  # typing.TypedDict on Python < 3.12: pydantic refuses it
    a: int


LOOSE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _valid_json(schema: dict) -> Callable[[Any, str], None]:
    def check(output: Any, text: str) -> None:
        jsonschema.validate(output, schema, format_checker=jsonschema.FormatChecker())
        assert json.loads(text) == output

    return check


def _instance_of(kind: type, *, exact: bool = False) -> Callable[[Any, str], None]:
    def check(output: Any, text: str) -> None:
        assert (type(output) is kind) if exact else isinstance(output, kind), (output, kind)

    return check


def _pydantic(cls: type[pydantic.BaseModel]) -> Callable[[Any, str], None]:
    def check(output: Any, text: str) -> None:
        assert isinstance(output, cls)
        assert cls.model_validate_json(text) == output

    return check


def _matches(pattern: str) -> Callable[[Any, str], None]:
    def check(output: Any, text: str) -> None:
        assert output == text and re.fullmatch(pattern, text, flags=re.DOTALL), (pattern, text)

    return check


def _member(values: list) -> Callable[[Any, str], None]:
    def check(output: Any, text: str) -> None:  # by type too: True == 1, but Literal[1] is not True
        assert any(type(v) is type(output) and v == output for v in values), (output, values)

    return check


def _items(cls: type[pydantic.BaseModel]) -> Callable[[Any, str], None]:
    def check(output: Any, text: str) -> None:
        assert isinstance(output, list) and all(isinstance(item, cls) for item in output), output
        assert [cls.model_validate(item.model_dump()) for item in output] == output

    return check


def _balanced_check(output: Any, text: str) -> None:
    assert output == text
    m = re.fullmatch(r"(\(*)o(\)*)", text)
    assert m and len(m.group(1)) == len(m.group(2)), text


def _any(output: Any, text: str) -> None:  # a spec that should have been refused: any answer is a bug
    raise AssertionError(f"a spec that should be refused was decoded: {text!r}")


def _schema(schema: dict) -> tuple[str, Any, Callable[[Any, str], None]]:
    return json.dumps(schema), schema, _valid_json(schema)


INT_BOUNDS = {"type": "integer", "minimum": -7, "maximum": 12}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "where": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "where", "tags"],
    "additionalProperties": False,
}

# (description for the reproducer, the spec, the check of its output). The CFG texts are Lark
# (llguidance dialect). Output types that should decode:
OutputType = tuple[str, Any, Callable[[Any, str], None]]
VALID_OUTPUTS: list[OutputType] = [
    ("None", None, _instance_of(str, exact=True)),
    ("Item", Item, _pydantic(Item)),
    ("Inventory", Inventory, _pydantic(Inventory)),
    ("list[Item]", list[Item], _items(Item)),
    ("Spot (dataclass)", Spot, _instance_of(Spot)),
    _schema(INT_BOUNDS),
    _schema({"type": "number", "exclusiveMinimum": 0, "maximum": 2.5}),
    _schema({"type": "string", "enum": ["red", "green", "blue"]}),
    _schema({"enum": [1, "one", None, True]}),
    _schema({"const": {"a": [1, 2]}}),
    _schema({"type": "boolean"}),
    _schema({"type": "null"}),
    _schema({"type": "string", "maxLength": 5, "pattern": "^[a-z]*$"}),
    _schema({"type": "string", "format": "date"}),
    _schema({"type": "string", "format": "date-time"}),
    _schema({"type": "array", "items": INT_BOUNDS, "minItems": 2, "maxItems": 4}),
    _schema(NESTED),
    _schema({"anyOf": [{"type": "integer", "minimum": 100}, {"type": "string", "maxLength": 3}]}),
    _schema({"type": "string", "maxLength": 10**12}),  # lowered to a count the parser reads
    ("Regex('[ab]{3}')", foveal.Regex("[ab]{3}"), _matches("[ab]{3}")),
    ("Regex('(yes|no)')", foveal.Regex("(yes|no)"), _matches("(yes|no)")),
    ("Regex('[0-9]{1,4}')", foveal.Regex("[0-9]{1,4}"), _matches("[0-9]{1,4}")),
    ("Regex('(é|ü){1,3}')", foveal.Regex("(é|ü){1,3}"), _matches("(é|ü){1,3}")),
    ("Regex('<eos>x')", foveal.Regex("<eos>x"), _matches("<eos>x")),
    ("Regex('x ; y')", foveal.Regex("x ; y"), _matches("x ; y")),
    ("Regex('a{2048}')", foveal.Regex("a{2048}"), _matches("a{2048}")),
    ("CFG x[ab]*", foveal.CFG('start: "x" item*\nitem: "a" | "b"'), _matches("x[ab]*")),
    ("CFG balanced", foveal.CFG('start: "(" start ")" | "o"'), _balanced_check),
    ("Literal['red', 'blue']", Literal["red", "blue"], _member(["red", "blue"])),
    ("Literal[1, 2.5, True, 'x']", Literal[1, 2.5, True, "x"], _member([1, 2.5, True, "x"])),
    ("['yes', 'no']", ["yes", "no"], _member(["yes", "no"])),
    ("Colour", Colour, _instance_of(Colour)),
    ("Size", Size, _instance_of(Size)),
    ("int", int, _instance_of(int, exact=True)),
    ("float", float, _instance_of(float, exact=True)),
    ("bool", bool, _instance_of(bool, exact=True)),
    ("str", str, _instance_of(str, exact=True)),
    ("datetime.date", datetime.date, _instance_of(datetime.date, exact=True)),
    ("datetime.time", datetime.time, _instance_of(datetime.time, exact=True)),
    ("datetime.datetime", datetime.datetime, _instance_of(datetime.datetime, exact=True)),
    # Added-token text (<locNNNN>) in an output type: see test_added_token_text_in_an_output_type_is_plain_text
]
# Output types at the edge: most must be refused before work (`_any`: decoding one at all is a
# violation); the others may be refused or decode, and then their answer is checked.
EDGE_OUTPUTS: list[OutputType] = [
    ("Regex('a{100000}')", foveal.Regex("a{100000}"), _any),
    ("Regex('a**')", foveal.Regex("a**"), _any),
    ("Regex('\\\\')", foveal.Regex("\\"), _any),
    ("CFG endless", foveal.CFG('start: "a" start'), _any),
    (
        "CFG 5000 alternatives",
        foveal.CFG("start: " + " | ".join(f'"w{i}"' for i in range(5000))),
        _member([f"w{i}" for i in range(5000)]),
    ),
    _schema({"$ref": "#"})[:2] + (_any,),
    _schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})[:2] + (_any,),
    _schema({"type": "string", "minLength": 100000})[:2] + (_any,),
    _schema({"type": "integer", "minimum": 10**30}),
    _schema({"type": "frobnicate"})[:2] + (_any,),
    ("False", False, _any),
    ("[]", [], _any),
    ("[1, 2]", [1, 2], _any),
    ("Literal[1, '1']", Literal[1, "1"], _any),
    ("'json'", "json", _any),
    ("42", 42, _any),
    ("object()", object(), _any),
    ("set", set, _any),
    ("Loose (typing.TypedDict)", Loose, _valid_json(LOOSE)),
]


# ---- images ----------------------------------------------------------------------------------------------------


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (valid CRC, no pixel data): must be refused unread."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


# ---- one drawn call --------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One drawn call: what `run` passes to the model, and how to write it as Python."""

    skill: str
    image: Any
    image_text: str
    text: Any = None  # phrase, question or prompt; caption's length
    output: tuple[str, Any, Callable | None] | None = None  # generate's output type
    settings: Any = None
    stream: str = ""  # caption/query: "" (no stream), "all" (read it all), "break" (stop early)
    encode: bool = False  # pass model.encode_image(image) instead of the image
    batch: bool = False  # `image` is a list: the skill runs on each (results or exceptions in order)

    def __str__(self) -> str:
        image = f"model.encode_image({self.image_text})" if self.encode else self.image_text
        if self.batch:
            image = f"[{', '.join(self.image_text)}]"
        args = [image, repr(self.text)] if self.skill != "caption" else [image, f"length={self.text!r}"]
        if self.skill == "generate":
            args.append(f"output_type={self.output[0]}")
        if self.stream:
            args.append(f"stream=True  # then {self.stream}")
        return f"model.{self.skill}({', '.join(args)}, settings={self.settings!r})"


WORDS = ["circle", "red circle", "shape", "blue square", "green triangle", "yellow shape", "thing"]
EDGE_TEXTS = [
    "",
    "   ",
    "\u00a0",
    "\n",
    "circle\nsquare",
    "circle\t",
    "x" * 199,
    "x" * 201,
    "very " * 1200 + "long",
    "círculo rojo ✓",
    "🔴 circle",
    "日本語の円",
    "\u200b",
    "circle\x00",
    "circle ; square",
    " ; ",
    ";",
    "<loc0005> circle",
    "<loc0031>",
    "<loc9999>",
    "<eos>",
    "circle <bos>",
    "<image>",
    "<pad>",
    "<unk>",
    "</s>",
    "<|endoftext|>",
    None,
    5,
    b"circle",
    ["circle"],
]
QUESTIONS = ["how many circles are there?", "what colour is the square?", "is there a triangle?"]
PROMPTS = ["describe the image", "caption normal", "detect circle", "answer in json", "hi"]


class Drawer:
    """Draws calls from one seeded generator; image files go to `files`."""

    def __init__(self, seed: int, files: Path) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.files = files
        self.n = 0

    def call(self) -> Call:
        r = self.rng
        self.n += 1
        skill = r.choice(SKILLS)
        image, image_text = self.image()
        call = Call(skill, image, image_text, settings=self.settings(skill))
        call.encode = r.random() < 0.1
        if r.random() < 0.08:  # a list of images: the batch path
            drawn = [self.image() for _ in range(r.randint(1, 3))]
            call.image, call.image_text = [d[0] for d in drawn], [d[1] for d in drawn]
            call.batch, call.encode = True, False
        if skill == "caption":
            call.text = r.choice(["short", "normal", "long"] * 4 + ["medium", None, 3, "SHORT"])
        elif skill == "query":
            call.text = self.text(QUESTIONS)
        elif skill in ("detect", "point"):
            call.text = self.text(WORDS)
        else:
            call.text = self.text(PROMPTS, multiline=True)
            call.output = r.choice(VALID_OUTPUTS if r.random() < 0.8 else EDGE_OUTPUTS)
        if skill in ("caption", "query") and r.random() < 0.25:
            call.stream = r.choice(["all", "break"])
        return call

    def text(self, ordinary: list[str], multiline: bool = False) -> Any:
        r = self.rng
        if r.random() < 0.7:
            return r.choice(ordinary)
        if multiline and r.random() < 0.2:
            return "line one\nline two\n" + r.choice(ordinary)
        return r.choice(EDGE_TEXTS)

    def image(self) -> tuple[Any, str]:
        r = self.rng
        if r.random() < 0.8:
            return self.scene()
        n = self.n
        bad: list[tuple[Any, str]] = [
            (None, "None"),
            (b"", "b''"),
            (b"not an image at all", "b'not an image at all'"),
            (encoded(scenes.render(scenes.generate_scene(n, 64)), "PNG")[:60], "<a PNG cut after 60 bytes>"),
            (png_header(100_000, 100_000), "png_header(100_000, 100_000)"),
            (np.zeros((40, 40, 3), np.float32), "np.zeros((40, 40, 3), np.float32)"),
            (np.zeros((40, 40, 3), np.int64), "np.zeros((40, 40, 3), np.int64)"),
            (np.zeros((40, 40, 5), np.uint8), "np.zeros((40, 40, 5), np.uint8)"),
            (np.zeros((0, 0, 3), np.uint8), "np.zeros((0, 0, 3), np.uint8)"),
            (np.zeros(40, np.uint8), "np.zeros(40, np.uint8)"),
            (str(self.files / "missing.png"), "'<tmp>/missing.png'"),
            (str(self.files), "'<tmp>' (a folder)"),
            (42, "42"),
            (Image.new("RGB", (1, 1)), "Image.new('RGB', (1, 1))"),
            (Image.new("P", (40, 30)), "Image.new('P', (40, 30))"),
        ]
        return r.choice(bad)

    def scene(self) -> tuple[Any, str]:
        r = self.rng
        seed, width, height = r.randrange(10_000), r.randint(32, 320), r.randint(32, 320)
        picture = scenes.render(scenes.generate_scene(seed, width, height))
        made = f"scenes.render(scenes.generate_scene({seed}, {width}, {height}))"
        form = r.choice(["pil", "pil", "L", "RGBA", "array", "gray array", "png", "jpeg", "path", "Path"])
        if form == "pil":
            return picture, made
        if form in ("L", "RGBA"):
            return picture.convert(form), f"{made}.convert({form!r})"
        if form == "array":
            return np.asarray(picture), f"np.asarray({made})"
        if form == "gray array":
            return np.asarray(picture.convert("L")), f"np.asarray({made}.convert('L'))"
        if form in ("png", "jpeg"):
            return encoded(picture, form.upper()), f"<{form.upper()} bytes of {made}>"
        path = self.files / f"{self.seed}_{self.n}.png"
        picture.save(path)
        return (str(path) if form == "path" else path), f"<{form} of a PNG of {made}>"

    def settings(self, skill: str) -> Any:
        r = self.rng
        roll = r.random()
        if roll < 0.3:
            return None
        if roll < 0.33:
            return r.choice([[("temperature", 0)], "greedy", 3, {"temperature"}])
        pick = {  # key: (valid values, invalid values)
            "temperature": ([0, 0.0, 0.5, 1.0, 2.0], [-1, math.nan, math.inf, "0.5", True, None]),
            "top_p": ([1, 0.9, 0.5, 1.0], [0, 1.5, -0.1, "x", math.nan]),
            "max_tokens": ([1, 2, 5, 16, 32, 64, 128, 200, 511], [512, 8192, 8193, 0, -1, 3.0, True, 2**70]),
            "max_objects": ([1, 2, 3, 5, 50, 1000], [0, 1001, "3", 2.0]),
            "seed": ([0, 1, 7, 2**32, 2**63, 2**64 - 1, 12345], [2**64, -1, 1.5, None, True, "7"]),
        }
        settings: dict[Any, Any] = {}
        for key, (valid, invalid) in pick.items():
            if key == "max_objects" and skill not in ("detect", "point") and r.random() > 0.05:
                continue
            if r.random() < 0.5:
                settings[key] = r.choice(valid if r.random() < 0.9 else invalid)
        if r.random() < 0.08:
            settings[r.choice(["temprature", "max_token", "stop", 5, ("seed",)])] = 1
        return settings


# ---- running a call and checking the contract ------------------------------------------------------------------


def run(model: Any, call: Call) -> Any:
    image = model.encode_image(call.image) if call.encode else call.image
    if call.skill == "caption":
        result = model.caption(image, length=call.text, stream=bool(call.stream), settings=call.settings)
    elif call.skill == "query":
        result = model.query(image, call.text, stream=bool(call.stream), settings=call.settings)
    elif call.skill == "generate":
        result = model.generate(image, call.text, output_type=call.output[1], settings=call.settings)
    else:
        result = getattr(model, call.skill)(image, call.text, settings=call.settings)
    if call.stream:
        key = "caption" if call.skill == "caption" else "answer"
        stream = result[key]
        if call.stream == "all":
            result[key] = "".join(stream)
        else:
            result[key] = next(iter(stream), "")
            stream.close()
    return result


def check_result(call: Call, result: Any) -> None:
    max_objects = 50
    if isinstance(call.settings, dict) and "max_objects" in call.settings:
        max_objects = call.settings["max_objects"]
    if call.skill == "caption":
        assert set(result) == {"caption"} and isinstance(result["caption"], str)
    elif call.skill == "query":
        assert set(result) == {"answer"} and isinstance(result["answer"], str)
    elif call.skill == "detect":
        assert set(result) == {"objects"} and len(result["objects"]) <= max_objects
        for box in result["objects"]:
            assert set(box) == {"x_min", "y_min", "x_max", "y_max", "score"}, box
            assert all(type(v) is float for v in box.values()), box
            assert 0 <= box["x_min"] < box["x_max"] <= 1 and 0 <= box["y_min"] < box["y_max"] <= 1, box
    elif call.skill == "point":
        assert set(result) == {"points"} and len(result["points"]) <= max_objects
        for point in result["points"]:
            assert set(point) == {"x", "y", "score"} and all(type(v) is float for v in point.values()), point
            assert 0 <= point["x"] <= 1 and 0 <= point["y"] <= 1, point
    else:
        assert set(result) == {"text", "output"} and isinstance(result["text"], str)
        checker = call.output[2]
        if checker is None:
            raise AssertionError(f"decoded a spec with no expected answer: {result['text']!r}")
        checker(result["output"], result["text"])


def check_batch(call: Call, results: Any) -> None:
    """A list call: one entry per image, in order; an image that failed holds its exception."""
    assert isinstance(results, list) and len(results) == len(call.image), results
    for entry in results:
        if isinstance(entry, Exception):
            allowed = (*PRE_WORK, foveal.IncompleteOutputError)
            assert type(entry) in allowed and str(entry).strip(), f"{type(entry).__name__}: {entry}"
        else:
            check_result(call, entry)


def violation(model: Any, spy: SubmitSpy, call: Call) -> str | None:
    """Run one call; None when it kept the contract, else what broke (with the call as Python)."""
    before = spy.accepted()
    try:
        result = run(model, call)
    except Exception as error:  # the contract is about which exceptions may escape
        accepted = spy.accepted() - before
        message = str(error).strip()
        if not message:
            return f"{call}\n  raised {type(error).__name__} with an empty message"
        if accepted == 0 and type(error) in PRE_WORK:
            return None
        if accepted and type(error) is foveal.IncompleteOutputError:
            return None
        when = "after its request was accepted" if accepted else "before work"
        return f"{call}\n  raised {type(error).__module__}.{type(error).__name__} {when}: {message[:300]}"
    try:
        if call.batch:
            check_batch(call, result)
        else:
            check_result(call, result)
    except Exception as error:
        return f"{call}\n  returned {dict(result)!r:.300} which breaks its shape: {error!r:.300}"
    return None


def assert_serves(model: Any, reference_image: Image.Image, reference: dict) -> None:
    assert model.detect(reference_image, REFERENCE_PHRASE) == reference, "the engine answers differently now"


def assert_idle_and_free(model: Any) -> None:
    assert model.engine.wait_idle(30), "the engine did not go idle"
    assert model.engine.free_pages() == model.engine.config.num_pages, "KV pages leaked"


def run_batch(model, spy, files, seed: int, n_calls: int) -> tuple[list[str], Counter]:
    drawer = Drawer(seed, files)
    problems, outcomes = [], Counter()
    for _ in range(n_calls):
        call = drawer.call()
        problem = violation(model, spy, call)
        outcomes["violation" if problem else "ok"] += 1
        if problem:
            problems.append(problem)
    return problems, outcomes


# ---- the tests -------------------------------------------------------------------------------------------------


def fuzz(model, spy, files, reference_image, reference, seeds, n_calls) -> None:
    for seed in seeds:
        problems, _ = run_batch(model, spy, files, seed, n_calls)
        assert_serves(model, reference_image, reference)
        assert not problems, f"seed {seed}: {len(problems)} broke the contract:\n" + "\n".join(problems)
    assert_idle_and_free(model)


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_keep_the_contract(model, spy, files, reference_image, reference, seed):
    fuzz(model, spy, files, reference_image, reference, [seed], 25)


def fuzz_from_threads(model, spy, files, reference_image, reference, first_seed, calls):
    """Four threads each run a batch of random calls at once; then the same checks as one thread."""
    with ThreadPoolExecutor(4) as pool:
        batches = list(pool.map(lambda s: run_batch(model, spy, files, first_seed + s, calls), range(4)))
    assert_serves(model, reference_image, reference)
    assert_idle_and_free(model)
    problems = [p for batch, _ in batches for p in batch]
    assert not problems, f"{len(problems)} broke the contract:\n" + "\n".join(problems)


def test_random_calls_from_four_threads_keep_the_contract(model, spy, files, reference_image, reference):
    fuzz_from_threads(model, spy, files, reference_image, reference, 1000, 12)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_random_calls_keep_the_contract_long(model, spy, files, reference_image, reference, seed):
    fuzz(model, spy, files, reference_image, reference, [seed], 60)


@pytest.mark.slow
def test_random_calls_from_four_threads_long(model, spy, files, reference_image, reference):
    fuzz_from_threads(model, spy, files, reference_image, reference, 2000, 50)


# ---- what the fuzz found ---------------------------------------------------------------------------------------

ADDED_TOKEN_TEXT = [
    ("Regex('x<loc0005>')", foveal.Regex("x<loc0005>"), "x<loc0005>"),
    ("Regex('<loc0005>a')", foveal.Regex("<loc0005>a"), "<loc0005>a"),
    ("{'const': 'x<seg001>'}", {"const": "x<seg001>"}, '"x<seg001>"'),
]


@pytest.mark.parametrize("name, spec, text", ADDED_TOKEN_TEXT, ids=[c[0] for c in ADDED_TOKEN_TEXT])
def test_added_token_text_in_an_output_type_is_plain_text(model, reference_image, name, spec, text):
    """Issue 13: special-token text in user text is handled one consistent way. grammars/tokenizer.py
    documents it as plain text, as `<eos>` is (`Regex('<eos>x')` decodes to '<eos>x'); a refusal
    before work in our own words, naming the token, would keep the contract too."""
    try:
        result = model.generate(reference_image, "hi", output_type=spec, settings={"max_tokens": 40})
    except foveal.SchemaError as error:
        assert "Parser Error" not in str(error) and ("<loc0005>" in str(error) or "<seg001>" in str(error))
    else:
        assert result["text"] == text
