"""Skills per family (prompt, output spec, parser) and generate's output parsers, without model weights.

Families are built over a `LoadedModel` that holds only a tokenizer: a skill call reads nothing else."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import types
import typing
from pathlib import Path

import pytest
from outlines.types import JsonSchema
from pydantic import BaseModel

import foveal
from foveal import grammars
from foveal.engine.models import Architecture, LoadedModel, ModelLoadError
from foveal.errors import GenerationError
from foveal.families import PaliGemmaFamily, ShapesFamily, family_for
from foveal.families.chat import ChatFamily
from foveal.families.conversation import user_turn
from foveal.families.prepared import reader
from foveal.families.shapes.format import ShapesFormat
from foveal.grammars import spatial
from foveal.skills import check_length, check_object, check_text, read_value
from foveal.vision import scenes

VISION = Architecture("llava", ("LlavaForConditionalGeneration",), "LlavaProcessor", image_token="<image>")
TEXT = Architecture("llama", ("LlamaForCausalLM",))


def loaded(tokenizer=None) -> LoadedModel:
    return LoadedModel(None, tokenizer, None, (), "test")


def ShapesSkills(fmt, tokenizer=None):  # noqa: N802 (reads as the family it builds)
    return ShapesFamily(loaded(tokenizer), fmt)


def PaliGemmaSkills(tokenizer=None):  # noqa: N802
    return PaliGemmaFamily(loaded(tokenizer))


def ChatSkills(tokenizer=None, image_token="<image>"):  # noqa: N802
    return ChatFamily(loaded(tokenizer), VISION if image_token else TEXT)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(builders):
    return builders.train_tokenizer()


# ---- shapes -----------------------------------------------------------------------------------------------------


def test_shapes_prompts_and_bins_come_from_foveal_json():
    fmt = ShapesFormat(n_bins=16, prompts={**ShapesFormat().prompts, "detect": "find {object}"})
    skills = ShapesSkills(fmt)
    task = skills.detect("red circle", 4)
    assert task.prompt == "find red circle"
    assert task.spec == spatial.boxes("loc", max_objects=4, label="red circle", bins=16)
    assert skills.point("star", 2).spec == spatial.points("loc", max_objects=2, label="star", bins=16)
    assert skills.caption("long").prompt == "caption long"
    assert skills.query("how many?").prompt == "answer how many?"


@pytest.mark.parametrize("seed", range(5))
def test_shapes_parsers_agree_with_the_training_format(seed):
    """The text the model was trained to write parses to the same boxes and points as the format's own parser."""
    fmt = ShapesFormat()
    skills = ShapesSkills(fmt)
    scene = scenes.generate_scene(seed)
    phrase = scene.objects[0].phrase()
    assert skills.detect(phrase, 50).parse(fmt.detect_target(scene, phrase)) == fmt.parse_detect(
        fmt.detect_target(scene, phrase)
    )
    assert skills.point(phrase, 50).parse(fmt.point_target(scene, phrase)) == fmt.parse_point(
        fmt.point_target(scene, phrase)
    )


def test_empty_answer_parses_to_no_objects():
    skills = ShapesSkills(ShapesFormat())
    assert skills.detect("x", 3).parse("") == []
    assert skills.point("x", 3).parse("") == []


def test_a_foveal_json_separator_is_what_the_grammar_and_the_parser_use():
    fmt = ShapesFormat(separator=" | ")
    task = ShapesSkills(fmt).detect("circle", 3)
    assert task.spec.separator == " | "
    text = fmt.locations.join([fmt.locations.box_item((0, 0, 0.5, 0.5), "circle")] * 2)
    assert " | " in text and task.parse(text) == fmt.parse_detect(text) and len(task.parse(text)) == 2


@pytest.mark.parametrize("separator", ["", "\n", "<loc0001>"])
def test_a_separator_the_format_cannot_use_is_refused_when_foveal_json_is_read(tmp_path, separator):
    ShapesFormat().save(tmp_path)
    path = tmp_path / "foveal.json"
    path.write_text(path.read_text().replace('" ; "', f'"{separator.encode("unicode_escape").decode()}"'))
    with pytest.raises(ValueError, match="foveal.json is not a valid foveal format file: separator"):
        ShapesFormat.load(tmp_path)


def test_the_shipped_foveal_json_loads():
    fmt = ShapesFormat.load(Path(foveal.__file__).parent / "embedded")
    assert fmt.separator == " ; " and fmt.locations.bins == fmt.n_bins


@pytest.mark.parametrize(
    "phrase, message",
    [
        ("circle ; square", "separator between answer items"),
        ("<loc0005> circle", "location-token text"),
    ],
)
def test_object_phrases_that_break_the_location_format_are_refused(phrase, message):
    for skills in (ShapesSkills(ShapesFormat()), PaliGemmaSkills()):
        for call in (skills.detect, skills.point):
            with pytest.raises(ValueError, match=message):
                call(phrase, 3)


def test_special_token_text_in_user_text_is_refused(tokenizer):
    """ "<eos>" in an object phrase or question would be read as the token itself, not as text."""
    for skills in (ChatSkills(tokenizer, "<image>"), PaliGemmaSkills(tokenizer)):
        with pytest.raises(ValueError, match="'<image>', a special token"):
            skills.detect("a <image> car", 3)
        with pytest.raises(ValueError, match="'<eos>', a special token"):
            skills.query("why<eos>?")
        with pytest.raises(ValueError, match="'<bos>', a special token"):
            skills.generate("say <bos>", None)
    assert ChatSkills(tokenizer, None).detect("a <thing>", 3).prompt  # angle brackets alone are text


@pytest.mark.parametrize(
    "skills, skill, text",
    [
        (ShapesSkills(ShapesFormat()), "detect", "<loc0001><loc0002> circle"),
        (ShapesSkills(ShapesFormat()), "point", "<loc0001><loc0002> circle ; "),
        (PaliGemmaSkills(), "point", "<loc0001>"),
        (ChatSkills(), "generate", '{"a": '),
    ],
)
def test_a_parse_failure_is_a_generation_error_naming_the_skill(skills, skill, text):
    task = skills.generate("x", {"type": "object"}) if skill == "generate" else getattr(skills, skill)("circle", 3)
    json_automaton = types.SimpleNamespace(parse=json.loads)  # what compile({"type": "object"}) carries
    with pytest.raises(GenerationError, match=f"^{skill}: the constrained answer"):
        read_value(skill, reader(task, json_automaton, frozenset(), 0.0), types.SimpleNamespace(text=text))


# ---- PaliGemma ---------------------------------------------------------------------------------------------------


def test_paligemma_uses_its_own_task_prefixes():
    skills = PaliGemmaSkills()
    assert skills.caption("short").prompt == "caption en"
    assert skills.caption("long").prompt == "describe en"
    assert skills.query("what colour?").prompt == "answer en what colour?"
    task = skills.detect("car", 5)
    assert task.prompt == "detect car" and task.spec.bins == 1024 and task.spec.label == "car"
    assert task.keep_special


def test_paligemma_point_is_the_centre_of_detect_boxes():
    task = PaliGemmaSkills().point("car", 5)
    assert task.prompt == "detect car" and task.spec.kind == "boxes"
    text = "<loc0000><loc0100><loc0200><loc0300> car ; <loc0511><loc0511><loc1023><loc1023> car"
    assert task.parse(text) == [
        {"x": 200 / 1023, "y": 100 / 1023},
        {"x": 767 / 1023, "y": 767 / 1023},
    ]


# ---- chat ------------------------------------------------------------------------------------------------------


def test_chat_without_template_uses_a_plain_layout(tokenizer):
    skills = ChatSkills(tokenizer, image_token=None)
    assert skills.template.render(user_turn("why?"))[0] == "Question: why?\nAnswer:"
    assert ChatSkills(tokenizer).template.render(user_turn("why?", 1))[0] == "Question: <image>\nwhy?\nAnswer:"
    task = skills.detect("car", 3)
    assert task.spec == spatial.boxes("json", max_objects=3) and not task.keep_special
    assert task.parse('{"objects": [{"x_min": 0, "y_min": 0.5, "x_max": 1, "y_max": 0.75}]}') == [
        {"x_min": 0, "y_min": 0.5, "x_max": 1, "y_max": 0.75}
    ]
    assert skills.point("car", 3).parse('{"points": [{"x": 0.25, "y": 1}]}') == [{"x": 0.25, "y": 1}]
    with pytest.raises(ValueError, match="no chat template, so it takes one user message"):
        skills.template.render((*user_turn("hi"), *user_turn("again")))


def test_chat_template_renders_as_transformers_tokenizes(builders):
    """The template writes BOS here, so the ids are the rendered text's without special tokens added:
    what tokenizer.apply_chat_template(tokenize=True) gives."""
    tok = builders.train_tokenizer()
    tok.chat_template = TEMPLATE
    text, special = ChatSkills(tok, image_token=None).template.render(user_turn("what is it?"))
    assert text == "<bos><|user|>what is it?<|end|><|assistant|>" and not special
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "what is it?"}], tokenize=True, add_generation_prompt=True
    )
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert tok(text, add_special_tokens=special)["input_ids"] == list(expected)


def test_a_skill_task_holds_the_ask_and_the_turn_is_built_with_the_calls_images(builders):
    tok = builders.train_tokenizer()
    tok.chat_template = TEMPLATE
    skills = ChatSkills(tok, image_token="<image>")
    task = skills.query("what is it?")
    assert task.prompt == "what is it?"
    assert skills.conversation(task, 1) == user_turn("what is it?", 1)
    assert skills.conversation(task, 0) == user_turn("what is it?", 0)


def test_family_for_picks_the_family(tmp_path):
    raw = {"architectures": ["PaliGemmaForConditionalGeneration"]}
    assert family_for(raw, tmp_path) is PaliGemmaFamily
    assert family_for({"architectures": ["LlamaForCausalLM"]}, tmp_path) is ChatFamily
    ShapesFormat(n_bins=8).save(tmp_path)
    assert family_for(raw, tmp_path) is ShapesFamily
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        family_for({"architectures": ["BertModel"]}, tmp_path)


# ---- argument checks ------------------------------------------------------------------------------------------


def test_argument_checks():
    assert check_length("short") == "short"
    with pytest.raises(ValueError, match="short, normal, long"):
        check_length("tiny")
    assert check_object("  red circle ") == "red circle"
    for bad, error in [
        ("", ValueError),
        ("\t", ValueError),
        (None, TypeError),
        (3, TypeError),
        ("x" * 300, ValueError),
    ]:
        with pytest.raises(error):
            check_object(bad)
    assert check_text("prompt", "line one\nline two") == "line one\nline two"  # prompts may span lines


# ---- generate's parsers ---------------------------------------------------------------------------------------


class Item(BaseModel):
    name: str
    n: int


@dataclasses.dataclass
class Pair:
    a: int
    b: str


class Colour(enum.Enum):
    RED = "red"
    ONE = 1


PARSED = [
    (str, "text", "text"),
    (grammars.Regex("[0-9]+"), "42", "42"),
    (grammars.CFG("start: /a+/"), "aaa", "aaa"),
    ({"type": "object"}, '{"k": [1, 2]}', {"k": [1, 2]}),
    (True, "[1]", [1]),
    (JsonSchema({"type": "integer"}), "7", 7),
    (typing.Literal["yes", "no"], "no", "no"),
    (typing.Literal[1, 2, True], "2", 2),
    (typing.Literal[1, 2, True], "true", True),
    (["a", "b"], "b", "b"),
    (Colour, "1", Colour.ONE),
    (Colour, "red", Colour.RED),
    (int, "-12", -12),
    (float, "2.5", 2.5),
    (bool, "True", True),
    (datetime.date, "2024-02-29", datetime.date(2024, 2, 29)),
    (Pair, '{"a": 1, "b": "x"}', Pair(1, "x")),
    (list[Item], '[{"name": "x", "n": 1}]', [Item(name="x", n=1)]),
    (spatial.points("json"), '{"points": []}', {"points": []}),
]


@pytest.mark.parametrize("output_type, text, value", PARSED, ids=[repr(p[0])[:40] for p in PARSED])
def test_the_parser_of_each_output_type(output_type, text, value):
    assert grammars.parser_of(output_type)(text) == value


def test_pydantic_class_parses_to_an_instance():
    item = grammars.parser_of(Item)('{"name": "x", "n": 3}')
    assert isinstance(item, Item) and item.n == 3


def test_a_text_outside_the_choices_raises():
    with pytest.raises(ValueError, match="none of the choices"):
        grammars.parser_of(typing.Literal["yes", "no"])("maybe")
