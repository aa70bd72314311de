"""The engine driving a real runner (`foveal.engine.models`, a tiny random Llama built from a config):
greedy tokens equal transformers' `generate`, pipelined == blocking for seeded sampling, and real
grammars constrain a real model."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers as tf

from foveal import grammars
from foveal.engine import Engine, EngineConfig, FinishReason, Request, SamplingParams

families = pytest.importorskip("foveal.families")

PROMPTS = ["the quick brown", "héllo wörld", "a", '{"x": 0.25', "日本語 🙂 and more text here"]


@pytest.fixture(scope="module")
def llama(tokenizer, tmp_path_factory):
    """(loaded foveal model, transformers reference model) for one tiny random Llama checkpoint."""
    hf_tok = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=hf_tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    folder = tmp_path_factory.mktemp("llama")
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    loaded = families.load(folder, device="cpu")
    reference = tf.LlamaForCausalLM.from_pretrained(folder).eval()
    return loaded, reference


def _config(loaded, pipelined: bool, **kw) -> EngineConfig:
    return EngineConfig(
        pipelined=pipelined,
        page_size=4,
        num_pages=256,
        max_model_len=256,
        max_batch=8,
        eos_token_ids=tuple(loaded.eos_token_ids),
        debug=True,
        **kw,
    )


def _transformers_greedy(loaded, reference, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy answer to each prompt, EOS dropped."""
    answers = []
    for ids in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        answers.append([t for t in out[0, len(ids) :].tolist() if t not in loaded.eos_token_ids])
    return answers


def _prompt_ids(loaded) -> list[list[int]]:
    return [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.mark.parametrize("pipelined", [True, False])
def test_greedy_tokens_equal_transformers_generate(llama, pipelined):
    loaded, reference = llama
    prompts = _prompt_ids(loaded)
    expected = _transformers_greedy(loaded, reference, prompts, 10)
    with Engine(loaded.runner, loaded.tokenizer, _config(loaded, pipelined)) as engine:
        outs = engine.generate([Request(ids, SamplingParams(max_tokens=10)) for ids in prompts], timeout=60)
    assert [o.token_ids for o in outs] == expected


def test_seeded_and_constrained_pipelined_equals_blocking(llama):
    loaded, _ = llama
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){1,3}"
    automaton = grammars.compile(
        grammars.Regex(pattern), loaded.tokenizer, vocab_size=loaded.runner.vocab_size
    )
    results = []
    for pipelined in (True, False):
        config = _config(loaded, pipelined, fill_masks=grammars.fill_masks)
        with Engine(loaded.runner, loaded.tokenizer, config) as engine:
            requests = [
                Request(
                    ids,
                    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=i),
                    automaton.matcher() if i % 2 else None,
                )
                for i, ids in enumerate(_prompt_ids(loaded) * 2)
            ]
            outs = engine.generate(requests, timeout=60)
            assert engine.wait_idle(5) and engine.free_pages() == engine.config.num_pages
        for i, out in enumerate(outs):
            if i % 2:
                assert out.finish_reason is FinishReason.STOP and re.fullmatch(pattern, out.text), out.text
        results.append([(o.token_ids, o.text, o.finish_reason) for o in outs])
    assert results[0] == results[1]


@pytest.mark.parametrize("pipelined", [True, False])
def test_prefix_cache_hits_give_transformers_greedy_tokens(llama, pipelined):
    """Questions over one shared document: the later ones reuse its pages (prefill starts past
    them), and every answer is still transformers' own greedy answer."""
    loaded, reference = llama
    document = loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3, add_special_tokens=False)
    prompts = [document + loaded.tokenizer.encode(q, add_special_tokens=False) for q in ("a", "héllo", "x y")]
    expected = _transformers_greedy(loaded, reference, prompts, 8)
    with Engine(loaded.runner, loaded.tokenizer, _config(loaded, pipelined)) as engine:
        first = engine.generate([Request(prompts[0], SamplingParams(max_tokens=8))], timeout=60)
        rest = engine.generate([Request(ids, SamplingParams(max_tokens=8)) for ids in prompts[1:]], timeout=60)
        stats = engine.stats()
        assert engine.wait_idle(5) and engine.free_pages() == engine.config.num_pages
    assert [o.token_ids for o in first + rest] == expected
    assert stats["cached_prompt_tokens"] >= 2 * (len(document) // 4 - 1) * 4  # both later prompts hit


@pytest.mark.parametrize("pipelined", [True, False])
def test_chunked_prefill_gives_transformers_greedy_tokens(llama, pipelined):
    """Long prompts prefilled 7 tokens a launch (their chunks attend to the pages the earlier ones
    wrote) beside rows already decoding: every answer is transformers' own greedy answer."""
    loaded, reference = llama
    text = "the quick brown fox jumps over the lazy dog "
    prompts = [loaded.tokenizer.encode(text * n + q, add_special_tokens=False) for n, q in ((1, "a"), (3, "x"), (2, "é"))]
    expected = _transformers_greedy(loaded, reference, prompts, 8)
    config = dataclasses.replace(_config(loaded, pipelined), prefill_chunk=7, prefix_cache=False)
    with Engine(loaded.runner, loaded.tokenizer, config) as engine:
        outs = engine.generate([Request(ids, SamplingParams(max_tokens=8)) for ids in prompts], timeout=60)
        stats = engine.stats()
        assert engine.wait_idle(5) and engine.free_pages() == engine.config.num_pages
    assert [o.token_ids for o in outs] == expected
    assert stats["prefill_rows"] > len(prompts)  # the prompts did take several chunks
