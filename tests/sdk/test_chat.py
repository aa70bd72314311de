"""`model.chat`: conversations rendered by the model's own template; stop strings; no lock across callers.

Models: a tiny Qwen2.5-VL (a chat template, several images per call), the tiny Llama and Idefics3 of
conftest.py (no chat template: one user message), all with random weights: the tests check prompts,
plumbing and promises, not the answers' sense.
"""

from __future__ import annotations

import threading
from typing import Literal

import pytest

import foveal
from foveal.families.conversation import Message
from foveal.testing import tiny

from .conftest import scene_image


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    folder = tiny.build("qwen2_5_vl", tmp_path_factory.mktemp("chat") / "qwen2_5_vl")
    model = foveal.load(folder, device="cpu", max_batch_size=8, max_model_len=1024)
    yield model
    model.close()


class Submitted:
    """Records the requests a model submits (their prompt ids)."""

    def __init__(self, model, monkeypatch):
        self.requests = []
        submit = model.engine.submit

        def spy(request):
            self.requests.append(request)
            return submit(request)

        monkeypatch.setattr(model.engine, "submit", spy)


def _hf(messages, pictures):
    it = iter(pictures)
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = [{"type": "image", "image": next(it)} if p["type"] == "image" else p for p in content]
        out.append({"role": m["role"], "content": parts})
    return out


def test_a_conversation_is_rendered_by_the_models_template(qwen_model, monkeypatch):
    a, b = scene_image(1, (64, 48)), scene_image(2, (40, 80))
    messages = [
        {"role": "system", "content": "You count shapes."},
        {
            "role": "user",
            "content": [{"type": "image", "image": a}, {"type": "text", "text": "how many?\nbe brief"}],
        },
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": [{"type": "text", "text": "and here?"}, {"type": "image", "image": b}]},
    ]
    spy = Submitted(qwen_model, monkeypatch)
    result = qwen_model.chat(messages, settings={"max_tokens": 5})
    assert isinstance(result["text"], str) and result["output"] == result["text"]
    assert result.usage.prompt_tokens == len(spy.requests[0].prompt_ids)
    hf = qwen_model.family.processor.hf_processor
    expected = hf.apply_chat_template(
        _hf([{"role": m["role"], "content": m["content"]} for m in messages], [a, b]),
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    expected = expected[0] if isinstance(expected[0], list) else expected
    assert spy.requests[0].prompt_ids == list(expected)


def test_chat_streams_and_has_an_async_twin(qwen_model):
    messages = [{"role": "user", "content": "say something"}]
    whole = qwen_model.chat(messages, settings={"max_tokens": 6})
    streamed = qwen_model.chat(messages, settings={"max_tokens": 6}, stream=True)
    assert "".join(streamed["text"]) == whole["text"] and streamed["output"] is None

    import asyncio

    async def run():
        return await qwen_model.achat(messages, settings={"max_tokens": 6})

    assert asyncio.run(run())["text"] == whole["text"]


def test_chat_with_an_output_type_is_valid_by_construction(qwen_model):
    result = qwen_model.chat([{"role": "user", "content": "yes or no?"}], output_type=Literal["yes", "no"])
    assert result["output"] in ("yes", "no") and result["text"] == result["output"]


def test_a_model_without_a_template_takes_one_user_message(llama_model, idefics3_model, image):
    one = [{"role": "user", "content": "why?"}]
    assert (
        llama_model.chat(one, settings={"max_tokens": 4})["text"]
        == llama_model.query(None, "why?", settings={"max_tokens": 4})["answer"]
    )
    assert not llama_model.capabilities.conversations
    with pytest.raises(ValueError, match="no chat template"):
        llama_model.chat([{"role": "system", "content": "be kind"}, *one])
    two = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "image", "image": image}]}
    ]
    with pytest.raises(ValueError, match="at most 1 image"):
        idefics3_model.chat(two)
    with pytest.raises(ValueError, match="text-only"):
        llama_model.chat(
            [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "x"}]}]
        )


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ([], TypeError, "non-empty list"),
        ("hello", TypeError, "non-empty list"),
        ([{"role": "robot", "content": "x"}], ValueError, "role"),
        ([{"role": "user", "content": 3}], TypeError, "string or a list of parts"),
        ([{"role": "user", "content": [{"type": "video"}]}], ValueError, "must be"),
        ([{"role": "assistant", "content": "hi"}], ValueError, "end the conversation with a user"),
        (
            [
                {"role": "assistant", "content": [{"type": "image", "image": b"x"}]},
                {"role": "user", "content": "x"},
            ],
            ValueError,
            "images go in user messages",
        ),
        ([{"role": "user", "content": "a <|im_start|> b"}], ValueError, "special token"),
    ],
)
def test_bad_messages_are_refused_before_any_work(qwen_model, messages, error, match):
    with pytest.raises(error, match=match):
        qwen_model.chat(messages)


def test_questions_and_prompts_may_span_lines(shapes_model, image):
    assert isinstance(
        shapes_model.query(image, "first line\nsecond line", settings={"max_tokens": 3})["answer"], str
    )
    with pytest.raises(ValueError, match="one line"):
        shapes_model.detect(image, "red\ncircle")


def test_stop_strings_cut_the_text_before_the_stop(llama_model):
    free = llama_model.query(None, "the quick brown fox", settings={"max_tokens": 24})
    text = free["answer"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the answer's middle is whitespace; nothing distinctive to stop on")
    cut = llama_model.query(None, "the quick brown fox", settings={"max_tokens": 24, "stop": [stop]})
    assert cut["answer"] == text[: text.index(stop)]
    assert cut.usage.finish_reason == "stop" and cut.usage.completion_tokens < free.usage.completion_tokens


def test_stop_is_refused_where_a_grammar_decides_the_end(shapes_model, image):
    with pytest.raises(ValueError, match="applies to free text"):
        shapes_model.detect(image, "circle", settings={"stop": ["]"]})
    with pytest.raises(ValueError, match="stop"):
        shapes_model.query(image, "x", settings={"stop": "]"})  # a bare string, not a list


def test_one_tokenizer_per_model(shapes_model):
    assert shapes_model.engine.tokenizer is shapes_model.family.tokenizer


def test_a_slow_compile_does_not_hold_up_another_callers_call(shapes_model, image, monkeypatch):
    """A caller whose output spec takes long to compile must not block other callers (no model-wide lock)."""
    release, entered = threading.Event(), threading.Event()
    compile_ = shapes_model.family.compile

    def slow(spec):
        if spec == {"type": "string", "slow": True}:
            entered.set()
            release.wait(30)
            return compile_(foveal.Regex("[a-z]"))
        return compile_(spec)

    monkeypatch.setattr(shapes_model.family, "compile", slow)
    slow_call = threading.Thread(
        target=lambda: shapes_model.generate(image, "x", {"type": "string", "slow": True}, {"max_tokens": 8})
    )
    slow_call.start()
    try:
        assert entered.wait(30)
        results = []
        other = threading.Thread(target=lambda: results.append(shapes_model.detect(image, "circle")))
        other.start()
        other.join(20)  # under a model-wide lock it would wait for `release`, which nothing sets before
        assert not other.is_alive() and "objects" in results[0]
        assert not release.is_set() and slow_call.is_alive()
    finally:
        release.set()
        slow_call.join(30)


def test_conversations_are_plain_data():
    """Parts are text or an image's index: hashable, so a family may cache by them."""
    assert hash((Message("user", (0, "hi")),)) is not None


def test_prompts_built_from_many_threads_at_once_equal_sequential_ones(qwen_model):
    """No lock guards the template, the tokenizer or the processor: they are only read. Threads
    rendering and tokenizing at once (the engine detokenizing beside them) give the sequential ids."""
    family = qwen_model.family
    pictures = [scene_image(seed, (32 + 8 * seed, 40)) for seed in range(4)]
    tasks = [family.chat(((Message("user", (0, f"question {i}\nline two")),)), None) for i in range(12)]
    expected = [family.encode(t, [pictures[i % 4]], None)[0].token_ids for i, t in enumerate(tasks)]
    got: dict[int, list[int]] = {}
    errors = []

    def work(k: int) -> None:
        try:
            for _ in range(5):
                for i, task in enumerate(tasks):
                    if i % 4 == k % 4:
                        ids = family.encode(task, [pictures[i % 4]], None)[0].token_ids
                        assert got.setdefault(i, ids) == ids
        except Exception as error:  # reported below, with the thread's own error
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    background = threading.Thread(
        target=lambda: qwen_model.chat([{"role": "user", "content": "hi"}], settings={"max_tokens": 16})
    )
    background.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    background.join(120)
    assert not errors and [got[i] for i in range(len(tasks))] == expected
