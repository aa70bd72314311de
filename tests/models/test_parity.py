"""Parity of every supported family with transformers: same greedy tokens, logits within 1e-4 (fp32).

Each family's tiny random checkpoint goes through `foveal.engine.models.load(folder)`; five prompts
of different lengths (five images of different sizes for vision families, plus a text-only prompt
where the family allows one) run together in one prefill launch and batched decode launches; the
reference is transformers' `generate` on each prompt alone.
"""

import pytest

from foveal.families import load
from foveal.testing import parity, tiny

TOLERANCE = 1e-4
FAMILIES = ["llama", "gemma", "paligemma", "idefics3", "smolvlm", "llava"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_match_transformers(family, checkpoints):
    loaded = load(checkpoints[family], device="cpu")
    assert loaded.name == family
    prompts = tiny.family_prompts(loaded)
    assert len({len(p.token_ids) for p in prompts}) >= 5
    reference = parity.reference_model(checkpoints[family])
    worst, equal = parity.compare(loaded, reference, prompts, max_new_tokens=8)
    assert equal, f"{family}: greedy tokens differ from transformers"
    assert worst < TOLERANCE, f"{family}: max logit difference {worst:.2e}"
