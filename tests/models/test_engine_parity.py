"""Real runners through foveal's engine: greedy tokens equal transformers' `generate`, pipelined and blocking."""

import pytest

from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.families import load
from foveal.testing import parity, tiny

MAX_NEW = 8


@pytest.mark.parametrize(
    ("family", "pipelined"), [("llama", True), ("llama", False), ("paligemma", True), ("idefics3", True)]
)
def test_engine_greedy_tokens_match_transformers(family, pipelined, checkpoints):
    loaded = load(checkpoints[family], device="cpu")
    prompts = tiny.family_prompts(loaded)
    expected = parity.reference_engine_tokens(loaded, checkpoints[family], prompts, MAX_NEW)
    config = EngineConfig(
        pipelined=pipelined, page_size=4, num_pages=256, max_model_len=256, eos_token_ids=loaded.eos_token_ids
    )
    with Engine(loaded.runner, loaded.tokenizer, config) as engine:
        requests = [
            Request(p.token_ids, SamplingParams(max_tokens=MAX_NEW), prefill=p.prefill) for p in prompts
        ]
        outputs = engine.generate(requests, timeout=60)
    assert [o.token_ids for o in outputs] == expected
