"""Speculative decoding over a real runner (a tiny random Llama through `foveal.engine.models`):
verify steps take the logits at several positions of a sequence (HFRunner, lean forward), and the
greedy tokens still equal transformers' `generate`; constrained outputs equal decoding without drafts."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from foveal import grammars
from foveal.engine import Engine, EngineConfig, Request, SamplingParams

families = pytest.importorskip("foveal.families")

TEXT = "the quick brown fox jumps over the lazy dog "


@pytest.fixture(scope="module")
def llama(tokenizer, tmp_path_factory):
    hf_tok = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(1)
    config = tf.LlamaConfig(
        vocab_size=hf_tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0,
        pad_token_id=0, bos_token_id=None, architectures=["LlamaForCausalLM"],
    )
    folder = tmp_path_factory.mktemp("llama")
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return families.load(folder, device="cpu"), tf.LlamaForCausalLM.from_pretrained(folder).eval()


def _config(loaded, pipelined: bool, **kw) -> EngineConfig:
    return EngineConfig(pipelined=pipelined, page_size=4, num_pages=256, max_model_len=256, max_batch=8,
                        eos_token_ids=tuple(loaded.eos_token_ids), debug=True, **kw)


def _prompts(loaded) -> list[list[int]]:
    return [loaded.tokenizer.encode(TEXT * n + q, add_special_tokens=False) for n, q in ((2, "the"), (3, "a"), (1, "x"))]


@pytest.mark.parametrize("pipelined", [True, False])
def test_greedy_tokens_with_drafts_equal_transformers_generate(llama, pipelined):
    loaded, reference = llama
    prompts = _prompts(loaded)
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        expected.append([t for t in out[0, len(ids) :].tolist() if t not in loaded.eos_token_ids])
    config = _config(loaded, pipelined, speculative="ngram")
    with Engine(loaded.runner, loaded.tokenizer, config) as engine:
        outs = [engine.generate([Request(ids, SamplingParams(max_tokens=24))], timeout=60)[0] for ids in prompts]
        stats = engine.stats()["speculative"]
        assert engine.wait_idle(5) and engine.free_pages() == engine.config.num_pages
    assert [o.token_ids for o in outs] == expected
    assert stats["verify_rows"] > 0


def test_constrained_and_seeded_outputs_equal_decoding_without_drafts(llama):
    loaded, _ = llama
    automaton = grammars.compile(grammars.Regex(r"(the|quick|brown|fox|a|dog)( (the|quick|brown|fox|a|dog)){2,12}"),
                                 loaded.tokenizer, vocab_size=loaded.runner.vocab_size)
    results = []
    for speculative in (None, "ngram"):
        config = _config(loaded, True, speculative=speculative, fill_masks=grammars.fill_masks)
        with Engine(loaded.runner, loaded.tokenizer, config) as engine:
            requests = [
                Request(ids, SamplingParams(max_tokens=32, temperature=0.7, seed=i), automaton.matcher() if i % 2 else None)
                for i, ids in enumerate(_prompts(loaded) * 2)
            ]
            outs = engine.generate(requests, timeout=60)
            assert engine.wait_idle(5) and engine.free_pages() == engine.config.num_pages
        results.append([(o.token_ids, o.text, o.finish_reason) for o in outs])
    assert results[0] == results[1]
