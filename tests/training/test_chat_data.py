"""The embedded model's chat data (foveal.training.chat_data) and its place in training: targets in the
forms the SDK's grammars and readers take, prompts exactly as `model.chat` renders them."""

import json

import jsonschema
import numpy as np
import pytest
import torch

from foveal import grammars
from foveal.families.conversation import tools_of
from foveal.families.template import ChatTemplate
from foveal.tools import plan, read_reply
from foveal.training import chat_data
from foveal.training import train_shapes as ts
from foveal.vision import scenes

from .test_train_shapes import TINY


def _new_scene(rng):
    return scenes.generate_scene(int(rng.integers(ts.TRAIN_SEED_BASE, 2**62)))


def _examples(kind, n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [chat_data.sample_chat(rng, _new_scene, kind) for _ in range(n)]


@pytest.mark.parametrize("kind", ["tool_call", "answer_tool"])
def test_tool_call_targets_read_back_as_calls_of_declared_tools_with_valid_arguments(kind):
    calls = 0
    for ex in _examples(kind, 120):
        tools = tools_of(ex.conversation)
        reply = read_reply(plan(None, tools, "auto", tool_format="hermes"), ex.target)
        if not reply.tool_calls:
            assert "<tool_call>" not in ex.target and ex.target  # a question no tool answers: text
            continue
        calls += 1
        (call,) = reply.tool_calls
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        assert call["name"] in declared
        jsonschema.validate(call["arguments"], declared[call["name"]])
    assert calls > 60


def test_tool_result_targets_relay_the_result_not_the_scene():
    for ex in _examples("tool_result"):
        tool_message = ex.conversation[-1]
        assert tool_message.role == "tool" and ex.target.isdigit()
        assert ex.target in tool_message.text


def test_json_targets_are_objects_in_foveals_json_spelling():
    for ex in _examples("json"):
        value = json.loads(ex.target)
        assert isinstance(value, dict) and json.dumps(value) == ex.target
        assert ex.conversation[0].text == chat_data.JSON_INSTRUCTION


@pytest.mark.parametrize("kind", chat_data.KINDS)
def test_targets_hold_no_reserved_tokens_and_conversations_end_with_the_user_or_a_tool(kind):
    for ex in _examples(kind, 40, seed=1):
        assert "<loc" not in ex.target and "<seg" not in ex.target
        assert ex.conversation[-1].role in ("user", "tool")
        assert sum(len(m.images) for m in ex.conversation) == len(ex.images)


def test_follow_ups_are_answered_about_the_latest_image():
    for ex in _examples("conversation", 200, seed=2):
        question = ex.conversation[-1].text
        for form in ("and how many ", "what about ", "how about "):
            if question.startswith(form):
                noun = question[len(form) : -1]
                assert ex.target == chat_data.count_answer(ex.images[-1], noun)


def test_chat_training_ids_equal_what_model_chat_sends(tmp_path):
    """A chat example's prompt ids are the processor's for the conversation rendered by the exported
    folder's own template through foveal's ChatTemplate (the SDK's path), images and tools included."""
    from transformers import PaliGemmaProcessor

    cfg = ts.TrainConfig(**TINY, task_weights={"detect": 1.0, "chat": 1.0})
    trainer = ts.Trainer(cfg)
    folder = trainer.export(tmp_path / "hf")
    processor = PaliGemmaProcessor.from_pretrained(folder)
    template = ChatTemplate(processor.tokenizer, processor, "<image>")
    assert template.available and template.tool_format == "hermes"
    rng = np.random.default_rng(3)
    for kind in chat_data.KINDS * 3:
        ex = chat_data.sample_chat(rng, _new_scene, kind)
        prompt, images = trainer.chat.render(ex.conversation)
        ids, n_prefix = ts.encode_example(trainer.tok, prompt, ex.target, trainer.n_image_tokens * images)
        text, special = template.render(ex.conversation)
        pictures = [scenes.render(s) for s in ex.images]
        kwargs = {} if special else {"add_special_tokens": False}
        got = processor(images=pictures, text=[text], suffix=ex.target, **kwargs)
        assert got["input_ids"][0] == ids
        assert got["token_type_ids"][0] == [0] * n_prefix + [1] * (len(ids) - n_prefix)


def test_a_chat_batch_shows_every_image_with_its_patch_targets():
    cfg = ts.TrainConfig(**TINY, task_weights={"detect": 1.0, "chat": 1000.0}, chat_batch_size=3)
    trainer = ts.Trainer(cfg)
    batch = ts.batch_for_step(0, cfg, trainer.fmt, trainer.tok, trainer.n_image_tokens, trainer.chat)
    images = int((batch.input_ids == trainer.model.config.image_token_id).sum()) // trainer.n_image_tokens
    assert batch.input_ids.shape[0] == 3
    assert batch.pixel_values.shape[0] == images == batch.patch_colour.shape[0]
    loss = trainer.train_step()
    assert np.isfinite(loss) and torch.isfinite(batch.pixel_values).all()


def test_hermes_calls_are_accepted_by_the_tool_grammar():
    from transformers import PreTrainedTokenizerFast

    tok = ts.build_tokenizer(ts.ShapesFormat())
    assert isinstance(tok, PreTrainedTokenizerFast)
    for ex in _examples("tool_call", 30, seed=4) + _examples("answer_tool", 30, seed=4):
        if "<tool_call>" not in ex.target:
            continue
        spec = plan(None, tools_of(ex.conversation), "required", tool_format="hermes").spec
        matcher = grammars.compile(spec, tok).matcher()
        for token_id in tok(ex.target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]:
            matcher.commit(token_id)  # raises on a token the grammar forbids
        assert matcher.is_terminated(), ex.target
