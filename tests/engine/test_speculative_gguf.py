"""Speculative decoding over a quantized GGUF runner (the tiny llama file of tests/models/test_gguf_tiny.py,
loaded as a user would): a guessed position is computed in a verify launch of up to
`drafts.MAX_LAUNCH_ROWS` rows, a plain decode position in a launch of one, and a forced run in one
multi-token query. With the default kernels (quant.SplitLinear's int4 for few rows, fbgemm's fp16 for
many and for the head) every position must come out of the same arithmetic either way: the tokens and
every recorded log-probability (and its alternatives) equal decoding without drafts, bit for bit. A
kernel whose rounding depends on a launch's row count shows here as logprobs a few ulps apart, long
before it flips a greedy near-tie in a real model.
"""

from __future__ import annotations

import pytest

from foveal import grammars
from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.engine.models.quant import HalfLinear, SplitLinear, fp16_kernel_available

families = pytest.importorskip("foveal.families")
pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not fp16_kernel_available(), reason="the default GGUF kernels need fbgemm (x86)")

TEXT = "the cat and the hat at the cat and "


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.models.test_gguf_tiny import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tied=True, seed=0)
    loaded = families.load(tiny.path, device="cpu", runner="torch")
    decoder = loaded.runner.model.get_decoder()
    assert isinstance(decoder.layers[0].mlp.up_proj, SplitLinear)
    assert isinstance(loaded.runner.model.lm_head, HalfLinear)
    # Eager launches only: a traced graph is made in the background, so whether a launch ran traced
    # or eager would depend on timing, and the two may round apart (drafts or not).
    loaded.runner.decode_graphs = None
    return loaded


def _run(loaded, speculative, pipelined, requests):
    config = EngineConfig(pipelined=pipelined, page_size=4, num_pages=256, max_model_len=128, max_batch=8,
                          eos_token_ids=tuple(loaded.eos_token_ids), speculative=speculative, jump_forward=True,
                          fill_masks=grammars.fill_masks)
    with Engine(loaded.runner, loaded.tokenizer, config) as engine:
        # one decode thread: answers compared bit for bit must not meet a probe of another count
        engine.device.small_launch_threads = 1
        outs = [engine.generate([request], timeout=120)[0] for request in requests]  # one call at a time
        stats = engine.stats()["speculative"]
        assert engine.wait_idle(5) and engine.free_pages() == engine.config.num_pages
    return [(o.token_ids, o.logprobs) for o in outs], stats


@pytest.mark.parametrize("pipelined", [True, False])
def test_greedy_tokens_and_logprobs_with_drafts_equal_decodings_on_a_quantized_gguf(tiny_gguf, pipelined):
    loaded = tiny_gguf
    automaton = grammars.compile(grammars.Regex(r"(the|cat|and|hat|at)( (the|cat|and|hat|at)){4,30}"),
                                 loaded.tokenizer, vocab_size=loaded.runner.vocab_size)

    def requests():
        prompts = [loaded.tokenizer.encode(TEXT * n, add_special_tokens=False) for n in (1, 2)]
        sampling = SamplingParams(max_tokens=32, logprobs=3)
        return [Request(ids, sampling, matcher) for ids in prompts for matcher in (None, automaton.matcher())]

    plain, _ = _run(loaded, None, pipelined, requests())
    drafted, stats = _run(loaded, "ngram", pipelined, requests())
    assert stats["accepted"] > 0
    assert drafted == plain

