"""Qwen3.5 (hybrid attention) on foveal's runner and engine (families/qwen3_5/), against transformers.

The tiny checkpoint (testing/tiny_qwen3_5.py) interleaves Gated DeltaNet linear-attention layers with
a full-attention layer. Prompts: Qwen-VL's (images of four sizes, one prompt with two, one text-only),
run together; greedy tokens must equal transformers' `generate` on each prompt alone and logits agree
within 1e-4, through the runner and the engine: pipelined and blocking, with chunked prefill, from the
prefix cache (the recurrent state's page snapshots) and the image cache, and with jump-forward runs.
Dropping the recurrent state between launches must break that.
"""

import dataclasses
import json
import shutil

import pytest
import safetensors.torch

import foveal
from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.engine.models import ModelLoadError
from foveal.engine.models.recurrent import Launch, RecurrentStates
from foveal.families import load
from foveal.testing import parity, tiny, tiny_qwen3_5

TOLERANCE = 1e-4
MAX_NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_qwen3_5.build_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny")


@pytest.fixture(scope="module")
def expected(folder):
    family = load(folder, device="cpu")
    reference = parity.reference_model(folder)
    return [parity.reference_greedy(reference, p, family.runner.arch, MAX_NEW) for p in tiny_qwen3_5.prompts(family)]


def _worst(family, expected, steps=MAX_NEW):
    ours = parity.greedy(family.runner, tiny_qwen3_5.prompts(family), steps, family.eos_token_ids)
    return parity.against(ours, expected, steps)


def test_runner_matches_transformers(folder, expected):
    family = load(folder, device="cpu")
    assert family.name == "qwen3_5"
    layout = family.runner.kv_layout
    assert layout.index == (-1, -1, 0, -1)  # only the full-attention layer has K/V
    assert sorted(family.runner.linear) == [0, 1, 3]
    worst, equal = _worst(family, expected)
    assert equal, "greedy tokens differ from transformers'"
    assert worst < TOLERANCE, f"max logit difference {worst:.2e}"


def test_dropping_the_recurrent_state_breaks_parity(folder, expected, monkeypatch):
    """Every launch starting from zero states (the state not carried from prefill to decode) fails."""
    family = load(folder, device="cpu")
    launch = RecurrentStates.launch

    def forgetful(self, batch):
        pieces = [dataclasses.replace(p, source=None) for p in launch(self, batch).pieces]
        return Launch(pieces, decode=False)

    monkeypatch.setattr(RecurrentStates, "launch", forgetful)
    worst, _ = _worst(family, expected, steps=2)
    assert worst > 100 * TOLERANCE, f"without the state still matched ({worst:.2e})"


@pytest.mark.parametrize("pipelined", [True, False])
def test_engine_matches_transformers(pipelined, folder, expected):
    family = load(folder, device="cpu")
    prompts = tiny_qwen3_5.prompts(family)
    expected = [[t for t in tokens if t not in family.eos_token_ids] for tokens, _ in expected]
    config = EngineConfig(
        pipelined=pipelined,
        page_size=4,
        num_pages=128,
        max_model_len=128,
        prefill_chunk=6,  # the text prompt is prefilled in chunks, across page boundaries
        eos_token_ids=family.eos_token_ids,
    )
    rounds = parity.engine_rounds(family.runner, family.tokenizer, prompts, config, MAX_NEW)
    assert rounds.first == expected
    assert rounds.again == expected  # from the prefix cache's pages and their state snapshots
    assert rounds.prefix_hit_rate > 0
    assert rounds.free_pages == config.num_pages  # every page (and with it its state row) came back


def test_jump_forward_and_blocking_give_the_same_grounding(folder):
    """A grounding answer's forced runs (fence, keys) are multi-token launches over the recurrent state."""
    picture = tiny.images(2)[1]
    answers, jumps = [], []
    for jump, pipelined in ((True, True), (False, True), (True, False)):
        with foveal.load(
            folder, device="cpu", max_batch_size=2, max_model_len=256, jump_forward=jump, pipelined=pipelined
        ) as model:
            answers.append(model.point(picture, "red circle", settings={"max_objects": 2, "max_tokens": 150}))
            jumps.append(model.engine.stats()["jumps"])
    assert answers[0] == answers[1] == answers[2]
    assert jumps[0] > 0 and jumps[1] == 0  # forced runs were multi-token launches, and only with jump-forward


def _copy(folder, tmp_path):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("vision_config"), "no vision_config"),
        (lambda c: c["text_config"].update(layer_types=["mamba"] * 4), "layer_types"),
    ],
)
def test_unsupported_configs_are_refused(folder, tmp_path, edit, message):
    out = _copy(folder, tmp_path)
    data = json.loads((out / "config.json").read_text())
    edit(data)
    (out / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=message):
        load(out, device="cpu")


def test_a_folder_missing_a_tensor_is_refused_naming_it(folder, tmp_path):
    out = _copy(folder, tmp_path)
    weights = safetensors.torch.load_file(out / "model.safetensors")
    name = next(k for k in weights if "linear_attn.A_log" in k)
    del weights[name]
    safetensors.torch.save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="A_log"):
        load(out, device="cpu")


def test_a_shared_prefix_resumes_from_its_page_snapshot(folder):
    """A prompt that shares only its first pages with an earlier one starts from the state those pages
    end with (their snapshot), and answers as transformers does on the whole prompt."""
    family = load(folder, device="cpu")
    reference = parity.reference_model(folder)
    base = tiny_qwen3_5.prompts(family)[4].token_ids
    other = base[:9] + base[2:6] + base[9:]  # the same first two pages of 4 tokens, then other tokens
    config = EngineConfig(page_size=4, num_pages=64, max_model_len=64, eos_token_ids=family.eos_token_ids)
    with Engine(family.runner, family.tokenizer, config) as engine:
        engine.generate([Request(base, SamplingParams(max_tokens=MAX_NEW))], timeout=60)
        (out,) = engine.generate([Request(other, SamplingParams(max_tokens=MAX_NEW))], timeout=60)
        assert engine.stats()["prefix_hit_rate"] > 0
    theirs, _ = parity.reference_greedy(reference, parity.PromptInputs(other, None), family.runner.arch, MAX_NEW)
    assert out.token_ids == [t for t in theirs if t not in family.eos_token_ids]


@pytest.mark.parametrize("pipelined", [True, False])
def test_reused_pages_never_carry_an_old_state(pipelined, folder):
    """A pool that holds two sequences at a time: every page, and its state row, is reused by later
    requests (some finishing early, as zombies in the pipeline); each answer is still transformers'."""
    family = load(folder, device="cpu")
    reference = parity.reference_model(folder)
    base = tiny_qwen3_5.prompts(family)[4].token_ids
    prompts = [base[k:] + base[:k] for k in range(0, 10, 2)]
    limits = [3, 8, 1, 6, 8]
    config = EngineConfig(
        pipelined=pipelined, page_size=4, num_pages=14, max_model_len=32, max_batch=2, eos_token_ids=()
    )
    with Engine(family.runner, family.tokenizer, config) as engine:
        outs = engine.generate(
            [Request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, limits, strict=True)],
            timeout=60,
        )
        engine.wait_idle(10)
        assert engine.free_pages() == config.num_pages
    for prompt, n, out in zip(prompts, limits, outs, strict=True):
        theirs, _ = parity.reference_greedy(reference, parity.PromptInputs(prompt, None), family.runner.arch, n)
        assert out.token_ids == theirs


def test_a_folder_without_its_image_processor_is_refused(folder, tmp_path):
    out = _copy(folder, tmp_path)
    (out / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no image processor settings \(preprocessor_config.json, or processor_config.json"):
        load(out, device="cpu")
