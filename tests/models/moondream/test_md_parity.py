"""Moondream's text decoder and region heads against the reference fixture (fp32), through the runner:
prompt logits and hidden states, every decode step's logits, greedy ids, coordinate / size logits and bins.

A one-sequence driver feeds `MoondreamRunner.forward` the launches the engine would (the prompt with
its image in one prefill, then one id per step, token or region value) and follows the reference's
decode loops; the figures are compared within the README's tolerance, discrete outputs exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from foveal.engine.runner import ForwardBatch
from foveal.families.moondream.answers import COORD, GATE, SIZE
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.load import MOONDREAM
from foveal.families.moondream.processor import MoondreamProcessor, MoondreamPrompt
from foveal.families.moondream.runner import MoondreamRunner
from foveal.families.moondream.weights import load_weights

from .conftest import tolerance

IMAGES = ("gradient_300x200", "multicrop_900x500", "small_64x64")
PAGE = 16


@pytest.fixture(scope="module")
def runner(md_dir):
    config = MoondreamConfig.from_dict(json.loads((md_dir / "config.json").read_text())["config"])
    weights = load_weights(md_dir / "model.safetensors", config, torch.device("cpu"), torch.float32)
    runner = MoondreamRunner(weights, MOONDREAM)
    runner.allocate_kv(128, PAGE)
    return runner


class Driver:
    """One sequence on the runner; its pages are 0.. in order, so a position's KV row is the position."""

    def __init__(self, runner: MoondreamRunner) -> None:
        self.runner = runner
        self.pos = 0

    def run(self, ids: list[int], prefill=None) -> tuple[torch.Tensor, torch.Tensor]:
        n, start = len(ids), self.pos
        positions = torch.arange(start, start + n)
        pages = -(-(start + n) // PAGE)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=positions,
            query_start=torch.tensor([0, n], dtype=torch.int32),
            context_lens=torch.tensor([start + n], dtype=torch.int32),
            block_tables=torch.arange(pages, dtype=torch.int32)[None],
            kv_index=positions.clone(),
            max_query_len=n,
            max_context_len=start + n,
            prefill=[prefill] if prefill is not None else [],
        )
        logits = self.runner.forward(batch)[0]
        self.pos += n
        return logits, self.runner.last_hidden[0]

    def sample(self, logits, hidden, kind: int) -> int:
        """The engine's sample job for one row: token argmax, then the region heads for a region kind."""
        sampled = logits.argmax()[None].clone()
        if kind:
            self.runner.sample_regions(hidden[None], torch.tensor([kind]), torch.tensor([0]), sampled)
        return int(sampled[0])


def prefill(runner, md_dir, figures, name, prompt_ids):
    driver = Driver(runner)
    processor = MoondreamProcessor(runner.config, None, runner.device, runner.dtype)
    image = Image.open(md_dir / figures["images"][name]["image"]["file"])
    inputs = processor(MoondreamPrompt(tuple(prompt_ids)), image, image_key=None)
    return driver, *driver.run(inputs.token_ids, inputs.prefill)


def close(got, ref, what):
    assert got.shape == ref.shape, what
    diff = float((got - ref).abs().max())
    assert diff <= tolerance(ref), f"{what}: max diff {diff}"
    return diff


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("task", ["caption_normal", "query"])
def test_text_answers(runner, md_dir, md_figures, md_tensors, name, task):
    fig = md_figures["images"][name][task]
    driver, logits, hidden = prefill(runner, md_dir, md_figures, name, fig["prompt_ids"])
    assert driver.pos - len(fig["prompt_ids"]) == fig["prompt_start_pos"] == 730
    close(logits, md_tensors[f"{name}.{task}.prompt_last_logits"], "prompt logits")
    close(hidden, md_tensors[f"{name}.{task}.prompt_last_hidden"], "prompt hidden")
    _greedy(driver, logits, fig, md_tensors.get(f"{name}.{task}.step_logits"))


def test_text_only_query(runner, md_figures, md_tensors):
    fig = md_figures["text_only"]
    driver = Driver(runner)
    logits, hidden = driver.run(fig["prompt_ids"])
    close(logits, md_tensors["text_only.prompt_last_logits"], "prompt logits")
    close(hidden, md_tensors["text_only.prompt_last_hidden"], "prompt hidden")
    _greedy(driver, logits, fig, md_tensors["text_only.step_logits"])


def _greedy(driver, logits, fig, step_logits):
    ids = [int(logits.argmax())]
    for step in range(len(fig["greedy_ids"])):
        raw, _ = driver.run([ids[-1]])
        assert driver.pos - 1 == fig["decode_steps"][step]["pos"]
        if step_logits is not None:
            close(raw, step_logits[step], f"decode step {step}")
        masked = raw.clone()
        masked[3] = float("-inf")  # the answer id, masked after the first token
        ids.append(int(masked.argmax()))
    assert ids[: len(fig["greedy_ids"])] == fig["greedy_ids"]


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("skill", ["detect", "point"])
def test_region_answers(runner, md_dir, md_figures, md_tensors, name, skill):
    """The reference's detect / point loop, as engine steps: GATE (eos or x), COORD (y), SIZE (w, h)."""
    fig = md_figures["images"][name][skill]
    with_size = skill == "detect"
    driver, logits, hidden = prefill(runner, md_dir, md_figures, name, fig["prompt_ids"])
    close(hidden, md_tensors[f"{name}.{skill}.prompt_last_hidden"], "prompt hidden")
    assert int(logits.argmax()) == fig["prompt_next_token"]
    coord_logits, size_logits, bins, sizes, positions, continues = [], [], [], [], [], []
    vocab = runner.vocab_size
    for _ in range(fig["max_objects"]):
        coord_logits.append(runner.region.coord_decoder(hidden[None])[0])
        value = driver.sample(logits, hidden, GATE)
        if value == 0:
            break
        bins.append(value - vocab)
        positions.append(driver.pos)
        logits, hidden = driver.run([value])
        coord_logits.append(runner.region.coord_decoder(hidden[None])[0])
        value = driver.sample(logits, hidden, COORD)
        bins.append(value - vocab)
        positions.append(driver.pos)
        logits, hidden = driver.run([value])
        if with_size:
            size_logits.append(runner.region.size_decoder(hidden[None])[0].view(2, -1))
            value = driver.sample(logits, hidden, SIZE)
            sizes.append(divmod(value - vocab - 1024, 1024))
            positions.append(driver.pos)
            logits, hidden = driver.run([value])
        continues.append(int(logits.argmax()))
    assert continues == [step["argmax"] for step in fig["continue_steps"]]
    assert bins == [step["argmax"] for step in fig["coord_steps"]]
    assert sizes == [(step["w_bin"], step["h_bin"]) for step in fig["size_steps"]]
    assert positions == fig["decode_positions"]
    close(torch.stack(coord_logits), md_tensors[f"{name}.{skill}.coord_logits"], "coordinate logits")
    if with_size:
        close(torch.stack(size_logits), md_tensors[f"{name}.{skill}.size_logits"], "size logits")


@pytest.mark.parametrize("name", IMAGES)
def test_prefix_hidden_rows(runner, md_dir, md_figures, md_tensors, name):
    """Hidden states of the BOS + image prefill at the recorded rows (bidirectional prefix)."""
    from foveal.engine.models.attention import PagedKV, build_context

    processor = MoondreamProcessor(runner.config, None, runner.device, runner.dtype)
    image = Image.open(md_dir / md_figures["images"][name]["image"]["file"])
    inputs = processor(MoondreamPrompt(()), image)
    ids = inputs.token_ids
    n = len(ids)
    positions = torch.arange(n)
    batch = ForwardBatch(
        torch.tensor(ids), positions, torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
        torch.arange(-(-n // PAGE), dtype=torch.int32)[None], positions.clone(), n, n, [inputs.prefill],
    )  # fmt: skip
    kv = runner.kv
    ctx = build_context(batch, PagedKV(kv.k, kv.v, kv.page_size, kv.scratch_page), torch.tensor([730]))
    with torch.inference_mode():
        x = runner._scatter_images(runner.embed(batch.input_ids), batch, ctx.query_seq, [(0, inputs.prefill)])
        hidden = runner.text(x, positions, ctx, runner.cos, runner.sin)
    rows = md_figures["images"][name]["vision"]["prefix_hidden_rows"]
    close(hidden[rows], md_tensors[f"{name}.prefix_hidden.rows"], "prefix hidden rows")
