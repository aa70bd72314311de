"""`foveal.load` and the `Model` facade on tiny random models: every public call, every input type,
every bad input (refused before any request is submitted, the engine serving the next call)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import re
import typing
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field

import foveal
from foveal.families import PaliGemmaFamily, ShapesFamily
from foveal.families.chat import ChatFamily
from foveal.grammars import spatial
from foveal.model import EncodedImage
from foveal.results import CaptionResult, DetectResult, GenerateResult, PointResult, QueryResult
from foveal.vision import ImageError, image_key, load_image

BOX = ("x_min", "y_min", "x_max", "y_max")
FEW = {"max_objects": 3}


class Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=0, le=9)
    color: typing.Literal["red", "green", "blue"]


def assert_boxes(objects, max_objects, bins=None):
    assert isinstance(objects, list) and len(objects) <= max_objects
    for box in objects:
        assert list(box) == [*BOX, "score"] and 0 <= box["score"] <= 1
        assert 0 <= box["x_min"] < box["x_max"] <= 1 and 0 <= box["y_min"] < box["y_max"] <= 1
        if bins:  # loc tokens: every coordinate is a bin k / (bins - 1)
            assert all(abs(box[k] * (bins - 1) - round(box[k] * (bins - 1))) < 1e-9 for k in BOX)


def _unscored(items):
    return [{k: v for k, v in item.items() if k != "score"} for item in items]


def assert_points(points, max_objects):
    assert isinstance(points, list) and len(points) <= max_objects
    for p in points:
        assert list(p) == ["x", "y", "score"] and 0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 and 0 <= p["score"] <= 1


class Spy:
    """Records the requests the engine accepted (wraps `engine.submit`; one it refuses is never queued)."""

    def __init__(self, model, monkeypatch):
        self.requests = []
        submit = model.engine.submit

        def spy(request):
            handle = submit(request)
            self.requests.append(request)
            return handle

        monkeypatch.setattr(model.engine, "submit", spy)


# ---- loading ---------------------------------------------------------------------------------------------------


def test_skills_follow_the_family(shapes_model, paligemma_model, llama_model):
    assert isinstance(shapes_model.family, ShapesFamily) and shapes_model.family.fmt.n_bins == 32
    assert type(paligemma_model.family) is PaliGemmaFamily
    assert type(llama_model.family) is ChatFamily
    assert "paligemma" in repr(paligemma_model)


def test_load_without_path_when_the_embedded_weights_are_missing_says_what_to_do(monkeypatch, tmp_path):
    import foveal.model as model_module

    monkeypatch.setattr(model_module, "EMBEDDED", tmp_path)  # a broken install: an empty folder
    with pytest.raises(foveal.ModelLoadError, match="missing.*reinstall.*train_shapes"):
        foveal.load()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_batch_size": 0}, ValueError),
        ({"max_batch_size": 2.5}, ValueError),
        ({"pipelined": "yes"}, TypeError),
        ({"max_model_len": -1}, ValueError),
        ({"kv_cache_bytes": 0}, ValueError),
        ({"max_step_tokens": 0}, ValueError),
        ({"prefix_cache": "yes"}, TypeError),
        ({"decode_burst": 0}, ValueError),
        ({"decode_burst": True}, ValueError),
    ],
)
def test_bad_load_arguments_fail_before_reading_weights(kwargs, error, shapes_folder, monkeypatch):
    import foveal.model as model_module

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the arguments were checked")

    monkeypatch.setattr(model_module.families, "load", no_weights)
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        foveal.load(shapes_folder, **kwargs)  # a loadable folder: only the argument check can refuse


def test_max_step_tokens_reaches_the_engine(shapes_folder):
    with foveal.load(shapes_folder, device="cpu", max_batch_size=4, max_step_tokens=96) as model:
        assert model.engine.config.max_step_tokens == 96
    with pytest.raises(ValueError, match="max_step_tokens must be >= max_batch"):
        foveal.load(shapes_folder, device="cpu", max_batch_size=8, max_step_tokens=4)


def test_decode_burst_reaches_the_engine(shapes_folder):
    with foveal.load(shapes_folder, device="cpu", max_batch_size=4) as model:
        assert model.engine.config.decode_burst == 8  # the CPU default
    with foveal.load(shapes_folder, device="cpu", max_batch_size=4, decode_burst=1) as model:
        assert model.engine.config.decode_burst == 1


def test_missing_folder_is_a_model_load_error(tmp_path):
    with pytest.raises(foveal.ModelLoadError):
        foveal.load(tmp_path / "nothing-here", device="cpu")


def test_max_model_len_beyond_the_model_is_refused(llama_folder):
    with pytest.raises(ValueError, match="exceeds this model's 512 positions"):
        foveal.load(llama_folder, device="cpu", max_model_len=100_000)


def test_public_names():
    assert foveal.Regex is foveal.grammars.Regex and foveal.CFG is foveal.grammars.CFG
    assert foveal.ImageError is ImageError
    with pytest.raises(AttributeError):
        foveal.no_such_name  # noqa: B018


# ---- skills on the shapes model (location tokens, prompts from foveal.json) ---------------------------------


def test_detect_is_the_loc_grammar_with_the_phrase_as_label(shapes_model, image):
    result = shapes_model.detect(image, "red circle", FEW)
    assert isinstance(result, DetectResult) and result.image is not None
    assert_boxes(result["objects"], 3, bins=32)
    spec = spatial.boxes("loc", max_objects=3, label="red circle", bins=32)
    raw = shapes_model.generate(image, "detect red circle", spec)
    item = r"(<loc00[0-3]\d>){4} red circle"
    assert re.fullmatch(rf"({item}( ; {item})*)?", raw["text"])
    # same prompt, same grammar, greedy (generate parses the answer; the skill also scores it)
    assert raw["output"] == {"objects": _unscored(result["objects"])}


def test_point_is_the_loc_grammar(shapes_model, image):
    result = shapes_model.point(image, "blue square", FEW)
    assert isinstance(result, PointResult)
    assert_points(result["points"], 3)
    spec = spatial.points("loc", max_objects=3, label="blue square", bins=32)
    raw = shapes_model.generate(image, "point blue square", spec)
    assert raw["output"] == {"points": _unscored(result["points"])}


def test_caption_and_query_are_text(shapes_model, image):
    for length in ("short", "normal", "long"):
        result = shapes_model.caption(image, length=length, settings={"max_tokens": 6})
        assert isinstance(result, CaptionResult) and isinstance(result["caption"], str)
    answer = shapes_model.query(image, "how many shapes?", settings={"max_tokens": 6})
    assert isinstance(answer, QueryResult) and isinstance(answer["answer"], str)
    # The prompt is foveal.json's: the same as generate with the template filled in.
    assert (
        answer["answer"]
        == shapes_model.generate(image, "answer how many shapes?", settings={"max_tokens": 6})["text"]
    )


def test_streaming_chunks_join_to_the_whole_answer(shapes_model, image):
    whole = shapes_model.caption(image, settings={"max_tokens": 8})["caption"]
    stream = shapes_model.caption(image, stream=True, settings={"max_tokens": 8})["caption"]
    assert not isinstance(stream, str)
    assert "".join(stream) == whole
    whole = shapes_model.query(image, "what?", settings={"max_tokens": 8})["answer"]
    assert (
        "".join(shapes_model.query(image, "what?", stream=True, settings={"max_tokens": 8})["answer"])
        == whole
    )


def test_breaking_out_of_a_stream_stops_its_generation(shapes_model, image, monkeypatch):
    """The result dict still holds the stream, yet leaving the loop cancels the request at once."""
    long = {"max_tokens": 200, "temperature": 1.0, "seed": 3}
    assert len(shapes_model.generate(image, "caption normal", settings=long)["text"]) > 20  # a long answer
    handles = []
    submit = shapes_model.engine.submit
    monkeypatch.setattr(shapes_model.engine, "submit", lambda r: handles.append(submit(r)) or handles[-1])
    result = shapes_model.caption(image, stream=True, settings=long)
    for _ in result["caption"]:
        break
    output = handles[0].result(timeout=10)
    assert output.finish_reason == "cancelled" and len(output.token_ids) < 200
    assert shapes_model.engine.wait_idle(10)
    assert shapes_model.engine.free_pages() == shapes_model.config.num_pages
    with pytest.raises(foveal.GenerationError, match="stopped before its end"):
        list(result["caption"])


def test_closing_a_stream_early_frees_its_sequence(shapes_model, image):
    stream = shapes_model.caption(image, stream=True, settings={"max_tokens": 200})["caption"]
    next(stream, None)
    stream.close()
    assert shapes_model.engine.wait_idle(10)
    assert shapes_model.engine.free_pages() == shapes_model.config.num_pages


# ---- input types -----------------------------------------------------------------------------------------------


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_every_image_type_gives_the_same_answer(shapes_model, image, images, tmp_path, monkeypatch):
    path = tmp_path / "scene.png"
    image.save(path)
    inputs = [image, str(path), path, _png(image), np.asarray(image), shapes_model.encode_image(image)]
    spy = Spy(shapes_model, monkeypatch)
    results = [shapes_model.detect(x, "red circle", FEW) for x in inputs]
    assert all(r == results[0] for r in results)
    keys = {r.prefill.image_key for r in spy.requests}
    assert keys == {image_key(load_image(image))}  # one key: a runner can reuse the encoding
    others = [shapes_model.detect(x, "red circle", FEW) for x in images[1:]]
    assert any(r != results[0] for r in others)  # the answer is about the image, not the same for all


def test_exif_orientation_is_applied(shapes_model, tmp_path):
    upright = Image.fromarray(np.kron(np.eye(4, 6), np.ones((12, 8))).astype(np.uint8) * 200).convert("RGB")
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what a sideways camera writes
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view"
    path = tmp_path / "sideways.jpg"
    stored.save(path, exif=exif.tobytes(), quality=95)
    viewed = ImageOps.exif_transpose(Image.open(path))
    assert viewed.size == upright.size
    assert shapes_model.detect(path, "shape", FEW) == shapes_model.detect(viewed, "shape", FEW)


def test_encode_image_is_reused_as_is(shapes_model, image):
    encoded = shapes_model.encode_image(image)
    assert isinstance(encoded, EncodedImage) and shapes_model.encode_image(encoded) is encoded
    assert encoded.key == image_key(load_image(image))


def test_an_encoded_image_key_cannot_be_forged(shapes_model, images):
    """A key always belongs to its pixels: no other image's cached answer can be returned."""
    first, second = shapes_model.encode_image(images[0]), shapes_model.encode_image(images[1])
    with pytest.raises(TypeError):
        EncodedImage(images[1], first.key)
    with pytest.raises(ValueError):
        dataclasses.replace(second, key=first.key)
    pixels = images[1].copy()
    encoded = EncodedImage(pixels)
    pixels.paste((0, 0, 0), (0, 0, pixels.width, pixels.height))  # edits after encoding change nothing
    assert encoded.key == second.key
    assert shapes_model.detect(encoded, "shape", FEW) == shapes_model.detect(images[1], "shape", FEW)


# ---- generate -------------------------------------------------------------------------------------------------


def test_generate_output_types(shapes_model, image):
    pyd = shapes_model.generate(image, "describe", Shape, {"max_tokens": 40})
    assert isinstance(pyd, GenerateResult) and isinstance(pyd["output"], Shape)
    assert Shape.model_validate_json(pyd["text"]) == pyd["output"]

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    js = shapes_model.generate(image, "describe", schema, {"max_tokens": 40})
    jsonschema.validate(js["output"], schema)
    assert js["output"] == json.loads(js["text"])

    rx = shapes_model.generate(image, "color?", foveal.Regex(r"(red|green|blue) [0-9]{1,2}"))
    assert re.fullmatch(r"(red|green|blue) [0-9]{1,2}", rx["output"]) and rx["output"] == rx["text"]

    cfg = shapes_model.generate(image, "sum", foveal.CFG('start: NUM "+" NUM\nNUM: /[0-9]{1,3}/'))
    assert re.fullmatch(r"[0-9]{1,3}\+[0-9]{1,3}", cfg["output"])

    lit = shapes_model.generate(image, "yes or no", typing.Literal["yes", "no"])
    assert lit["output"] in ("yes", "no")

    free = shapes_model.generate(image, "say something", settings={"max_tokens": 5})
    assert free["output"] == free["text"]


def test_generate_without_image_on_a_text_model(llama_model):
    result = llama_model.generate(None, "count to three", foveal.Regex(r"[1-3]( [1-3]){2}"))
    assert re.fullmatch(r"[1-3]( [1-3]){2}", result["output"])
    assert result.image is None


# ---- PaliGemma and chat families --------------------------------------------------------------------------------


def test_paligemma_detect_uses_1024_bins_and_point_uses_box_centres(paligemma_model, image):
    boxes = paligemma_model.detect(image, "car", FEW)["objects"]
    assert_boxes(boxes, 3, bins=1024)
    points = paligemma_model.point(image, "car", FEW)["points"]
    centres = [{"x": (b["x_min"] + b["x_max"]) / 2, "y": (b["y_min"] + b["y_max"]) / 2} for b in boxes]
    assert _unscored(points) == centres
    assert [p["score"] for p in points] == [b["score"] for b in boxes]  # a point carries its box's score
    spec = spatial.boxes("loc", max_objects=3, label="car", bins=1024)
    assert paligemma_model.generate(image, "detect car", spec)["output"] == {"objects": _unscored(boxes)}
    assert isinstance(paligemma_model.caption(image, "long", settings={"max_tokens": 4})["caption"], str)
    assert isinstance(paligemma_model.query(image, "what?", settings={"max_tokens": 4})["answer"], str)


def test_chat_family_answers_spatial_skills_in_json(idefics3_model, llama_model, image):
    boxes = idefics3_model.detect(image, "car", FEW)["objects"]
    assert_boxes(boxes, 3)
    assert_points(idefics3_model.point(image, "car", FEW)["points"], 3)
    raw = llama_model.generate(None, "boxes", spatial.boxes("json", max_objects=2))
    assert raw["output"] == json.loads(raw["text"]) and len(raw["output"]["objects"]) <= 2
    assert isinstance(idefics3_model.caption(image, settings={"max_tokens": 4})["caption"], str)
    assert isinstance(llama_model.query(None, "why?", settings={"max_tokens": 4})["answer"], str)


@pytest.mark.parametrize("skill", ["caption", "detect", "point"])
def test_image_skills_without_an_image_are_refused_on_every_model(
    llama_model, idefics3_model, monkeypatch, skill
):
    """A text-only model cannot caption or find objects: it would describe an imaginary image."""
    args = () if skill == "caption" else ("circle",)
    for model, message in ((llama_model, "text-only"), (idefics3_model, "needs an image")):
        spy = Spy(model, monkeypatch)
        with pytest.raises(ValueError, match=message):
            getattr(model, skill)(None, *args)
        assert spy.requests == []


def test_query_without_an_image_on_a_vision_chat_model_has_no_image_placeholder(idefics3_model, monkeypatch):
    spy = Spy(idefics3_model, monkeypatch)
    answer = idefics3_model.query(None, "what is it?", settings={"max_tokens": 4})["answer"]
    assert isinstance(answer, str)
    placeholder = idefics3_model.family.tokenizer.convert_tokens_to_ids("<image>")
    assert placeholder not in spy.requests[0].prompt_ids


def test_seeded_sampling_is_reproducible(shapes_model, image):
    hot = {"temperature": 1.5, "seed": 7, "max_tokens": 12}
    assert shapes_model.caption(image, settings=hot) == shapes_model.caption(image, settings=hot)
    a = shapes_model.detect(image, "shape", {**hot, "max_tokens": 40, **FEW})
    assert a == shapes_model.detect(image, "shape", {**hot, "max_tokens": 40, **FEW})


# ---- bad input: refused before any work, the engine serves the next call ----------------------------------------


def _corrupt_png(image) -> bytes:
    data = _png(image)
    return data[: len(data) // 2]


BAD_CALLS = [
    (
        "image of a wrong type",
        lambda m, im: m.detect(12345, "car"),
        ImageError,
        "cannot use an image of type int",
    ),
    ("object not a string", lambda m, im: m.detect(im, 7), TypeError, "object must be a string"),
    ("empty object phrase", lambda m, im: m.detect(im, "  "), ValueError, "object is empty"),
    ("multi-line object phrase", lambda m, im: m.point(im, "a\nb"), ValueError, "one line"),
    ("question not a string", lambda m, im: m.query(im, None), TypeError, "question must be a string"),
    ("bad caption length", lambda m, im: m.caption(im, length="medium"), ValueError, "length='medium'"),
    ("max_tokens 0", lambda m, im: m.caption(im, settings={"max_tokens": 0}), ValueError, "'max_tokens' = 0"),
    (
        "max_tokens huge",
        lambda m, im: m.caption(im, settings={"max_tokens": 10**9}),
        ValueError,
        "max_tokens",
    ),
    (
        "max_tokens beyond context",
        lambda m, im: m.caption(im, settings={"max_tokens": 8000}),
        ValueError,
        "does not fit",
    ),
    (
        "unknown setting",
        lambda m, im: m.detect(im, "car", {"temprature": 1}),
        ValueError,
        "did you mean 'temperature'",
    ),
    ("setting of a wrong type", lambda m, im: m.detect(im, "car", {"seed": "1"}), ValueError, "'seed'"),
    ("settings not a dict", lambda m, im: m.detect(im, "car", [1]), ValueError, "settings must be a dict"),
    (
        "max_objects on caption",
        lambda m, im: m.caption(im, settings={"max_objects": 2}),
        ValueError,
        "max_objects",
    ),
    (
        "invalid schema",
        lambda m, im: m.generate(im, "x", {"type": "array", "uniqueItems": True}),
        foveal.SchemaError,
        "uniqueItems",
    ),
    ("bad regex", lambda m, im: m.generate(im, "x", foveal.Regex("(ab")), foveal.SchemaError, "regex"),
    ("bare string output type", lambda m, im: m.generate(im, "x", "json"), foveal.SchemaError, "ambiguous"),
    ("empty prompt", lambda m, im: m.generate(im, ""), ValueError, "prompt is empty"),
    ("corrupt image", lambda m, im: m.detect(_corrupt_png(im), "car"), ImageError, "corrupt|truncated"),
    ("missing file", lambda m, im: m.detect("/no/such/file.png", "car"), ImageError, "not found"),
    (
        "image bomb",
        lambda m, im: m.detect(np.zeros((9000, 9000, 3), np.uint8), "car"),
        ImageError,
        "decompression",
    ),
    ("no image on PaliGemma", lambda m, im: m.detect(None, "car"), ValueError, "needs an image"),
    (
        "object phrase holding the separator",
        lambda m, im: m.detect(im, "circle ; square"),
        ValueError,
        "separator between answer items",
    ),
    (
        "object phrase holding a special token",
        lambda m, im: m.point(im, "<loc0005> circle"),
        ValueError,
        "'<loc0005>', a special token",
    ),
    ("question holding a special token", lambda m, im: m.query(im, "why <eos>"), ValueError, "special token"),
    ("stream over a list", lambda m, im: m.caption([im, im], stream=True), ValueError, "one image"),
    ("unknown skill in map", lambda m, im: m.map("segment", [im], "car"), ValueError, "unknown skill"),
]


@pytest.mark.parametrize("name, call, error, message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused_before_work_and_the_engine_serves_on(
    shapes_model, image, monkeypatch, name, call, error, message
):
    reference = shapes_model.detect(image, "red circle", FEW)
    spy = Spy(shapes_model, monkeypatch)
    if name == "image bomb":
        monkeypatch.setenv("FOVEAL_MAX_IMAGE_PIXELS", "1000000")
    with pytest.raises(error, match=message):
        call(shapes_model, image)
    assert spy.requests == []
    assert shapes_model.detect(image, "red circle", FEW) == reference


def test_image_on_a_text_only_model_is_refused(llama_model, image):
    with pytest.raises(ValueError, match="text-only"):
        llama_model.query(image, "what?")


def test_an_answer_cut_by_max_tokens_raises_instead_of_a_partial_value(shapes_model, image):
    with pytest.raises(foveal.IncompleteOutputError, match="max_tokens=3") as info:
        shapes_model.generate(image, "spell", foveal.Regex("[a-z]{40}"), {"max_tokens": 3})
    assert re.fullmatch("[a-z]+", info.value.text)
    assert shapes_model.detect(image, "red circle", FEW)["objects"] is not None


def test_closing_the_model_mid_stream_raises_generation_error_sync_and_async(shapes_folder, image):
    long = {"max_tokens": 200, "temperature": 0.0}
    model = foveal.load(shapes_folder, device="cpu", max_batch_size=2, max_model_len=256)
    stream = model.caption(image, stream=True, settings=long)["caption"]
    next(stream)
    model.close()
    with pytest.raises(foveal.ModelClosedError, match="cancelled, the model is closed"):
        list(stream)

    async def consume():
        model = foveal.load(shapes_folder, device="cpu", max_batch_size=2, max_model_len=256)
        result = await model.acaption(image, stream=True, settings=long)
        async for _ in result["caption"]:
            model.close()

    with pytest.raises(foveal.ModelClosedError, match="cancelled, the model is closed"):
        asyncio.run(consume())


def test_a_closed_model_refuses_calls(shapes_folder, image):
    model = foveal.load(shapes_folder, device="cpu", max_batch_size=2, max_model_len=128)
    assert model.caption(image, settings={"max_tokens": 2})
    model.close()
    with pytest.raises(foveal.ModelClosedError, match="the model is closed"):  # what in-flight calls get
        model.caption(image, settings={"max_tokens": 2})
    assert isinstance(model.detect([image], "x")[0], foveal.ModelClosedError)
    assert issubclass(foveal.ModelClosedError, foveal.GenerationError)


def test_result_renders_with_its_image(shapes_model, image):
    result = shapes_model.detect(image, "red circle", FEW)
    assert result._repr_png_().startswith(b"\x89PNG")
    assert result.annotated().size == image.size
    assert json.loads(json.dumps(result)) == dict(result)


def test_paths_are_accepted_as_path_objects(shapes_model, image, images, tmp_path):
    path = Path(tmp_path) / "x.png"
    image.save(path)
    assert shapes_model.point(path, "x", FEW) == shapes_model.point(image, "x", FEW)
    other = Path(tmp_path) / "y.png"
    images[2].save(other)
    assert shapes_model.point(other, "x", FEW) == shapes_model.point(images[2], "x", FEW)
    assert shapes_model.point(other, "x", FEW) != shapes_model.point(path, "x", FEW)  # the file is read


def test_a_phrase_too_long_for_any_answer_is_refused_before_work(shapes_model, image, monkeypatch):
    """Issue 13: a 200-character phrase passed validation, then failed after decoding ("raise
    max_tokens", then "use max_tokens <= N"). What cannot fit is refused up front, with the rule."""
    spy = Spy(shapes_model, monkeypatch)
    phrase = "x" * 199  # ~1 token a character: one answer item cannot fit beside the prompt in 256 tokens
    with pytest.raises(ValueError, match="item takes .* tokens with this object phrase"):
        shapes_model.detect(image, phrase)
    with pytest.raises(ValueError, match=r"cannot hold one point item .* use max_tokens >= \d+"):
        shapes_model.point(image, "red circle", {"max_tokens": 3})
    assert spy.requests == []


def test_max_objects_is_lowered_to_what_max_tokens_holds(shapes_model, image, monkeypatch):
    """A complete answer always fits: the grammar allows only as many items as the budget holds."""
    spy = Spy(shapes_model, monkeypatch)
    spec = shapes_model.family.detect("shape", 1).spec
    tokens = spatial.item_token_bounds(spec, shapes_model.family.tokenizer).answer(2)  # the worst case
    result = shapes_model.detect(image, "shape", {"max_tokens": tokens, "max_objects": 50})
    assert 0 <= len(result["objects"]) <= 2
    assert spy.requests[0].matcher.automaton.key.startswith("spatial:boxes:loc:2:")


def test_an_output_type_whose_fixed_start_cannot_fit_is_refused_before_work(shapes_model, image, monkeypatch):
    """Issue 13: `Regex('a{2048}')` decoded until max_tokens, then raised IncompleteOutputError. The
    compiled spec knows the tokens its forced start takes; more than max_tokens is refused up front."""
    spy = Spy(shapes_model, monkeypatch)
    with pytest.raises(ValueError, match="starts with 60 tokens of fixed text, more than the 40"):
        shapes_model.generate(image, "x", foveal.Regex("a{60}"), {"max_tokens": 40})
    assert spy.requests == []
    assert shapes_model.generate(image, "x", foveal.Regex("a{40}"), {"max_tokens": 40})["text"] == "a" * 40


def test_a_model_dropped_without_close_stops_its_engine(shapes_folder, image):
    """Issue 13: reloading a model in a notebook without close() kept the old engine's threads and
    memory alive (~120 MB a reload). A dropped Model now closes its engine when collected."""
    import gc

    model = foveal.load(shapes_folder, device="cpu", max_batch_size=2, max_model_len=256)
    model.detect(image, "circle", FEW)
    thread = model.engine._thread
    stream = foveal.load(shapes_folder, device="cpu", max_batch_size=2, max_model_len=256).caption(
        image, stream=True, settings={"max_tokens": 4}
    )["caption"]
    del model
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance("".join(stream), str)  # the stream holds its model: its engine still runs


def test_results_and_streams_carry_their_usage(shapes_model, image, monkeypatch):
    """A result's `.usage` is the engine's own count (prompt tokens with the image's, generated tokens,
    why it ended); a stream carries it once read to the end, sync and async alike."""
    import asyncio

    spy = Spy(shapes_model, monkeypatch)
    detect = shapes_model.detect(image, "circle", FEW)
    assert detect.usage == foveal.Usage(len(spy.requests[0].prompt_ids), detect.usage.completion_tokens, "stop")
    assert detect.usage.completion_tokens >= 1
    caption = shapes_model.caption(image, settings={"max_tokens": 5, "temperature": 1.0, "seed": 3})
    stream = shapes_model.caption(image, stream=True, settings={"max_tokens": 5, "temperature": 1.0, "seed": 3})
    assert stream.usage is None and stream["caption"].usage is None
    assert "".join(stream["caption"]) == caption["caption"]
    assert stream["caption"].usage == caption.usage and caption.usage.completion_tokens <= 5

    async def read_async() -> tuple[str, object]:
        result = await shapes_model.acaption(image, stream=True, settings={"max_tokens": 5, "temperature": 1.0, "seed": 3})
        text = "".join([chunk async for chunk in result["caption"]])
        return text, result["caption"].usage

    assert asyncio.run(read_async()) == (caption["caption"], caption.usage)


def test_the_prefix_cache_is_on_by_default_and_answers_the_same(llama_folder):
    """Questions over one document through foveal.load: the later calls reuse its prompt pages
    (engine stats) and answer exactly what a model without the cache answers."""
    document = "the quick brown fox jumps over the lazy dog. " * 6
    questions = [f"{document} question {i}: what jumps?" for i in range(3)]
    answers = {}
    for cache in (True, False):
        with foveal.load(llama_folder, device="cpu", max_model_len=256, prefix_cache=cache) as model:
            answers[cache] = [model.query(None, q, settings={"max_tokens": 6})["answer"] for q in questions]
            cached = model.engine.stats()["cached_prompt_tokens"]
        assert (cached > 0) is cache
    assert answers[True] == answers[False]


def test_query_follows_the_references_argument_order_and_says_so(shapes_model, image):
    """query(image, question, reasoning, spatial_refs, stream, settings): settings passed third, as
    foveal's old order had it, is refused naming the argument it landed in."""
    with pytest.raises(TypeError, match=r"reasoning must be True or False, got \{'max_tokens': 5\}.*settings=\.\.\. by keyword"):
        shapes_model.query(image, "how many?", {"max_tokens": 5})
    assert isinstance(shapes_model.query(image, "how many?", False, None, False, {"max_tokens": 3})["answer"], str)
