"""Moondream 3 against the moondream3-tiny reference fixture (fp32), float for float, through the runner
of `foveal.load(fixture)`: crops, vision features, image embeddings, the prefix's hidden rows, prompt and
decode-step logits, reasoning steps, coordinate and size logits, eye and spatial-reference encodings; for
the preview's exact tau GELU (`figures.*`) and the tanh variant (`figures_tau_tanh.*`).

A one-sequence driver feeds the loaded model's runner the launches the engine would (the prompt with its
image in one prefill, then one id per step) and follows the reference's loops; floats are checked against
the README's absolute tolerance (1e-4, which tells the two tau GELUs apart), discrete decisions exactly.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import foveal
from foveal.engine.models.attention import PagedKV, build_context
from foveal.engine.runner import ForwardBatch
from foveal.families.moondream import vision
from foveal.families.moondream.answers import COORD, GATE, SIZE
from foveal.families.moondream.processor import Coord, MoondreamProcessor, MoondreamPrompt, Size

from .md3 import IMAGES, TOLERANCE, figures, tanh_folder

PAGE = 16
ANSWER, EOS, SIZE_ID, COORD_ID = 3, 0, 6, 5


@pytest.fixture(scope="module")
def runners(md3_dir, tmp_path_factory):
    """One runner per tau GELU, from foveal.load; the driver's pages are its own (0.. in order)."""
    out = {}
    for gelu, folder in (("exact", md3_dir), ("tanh", tanh_folder(md3_dir, tmp_path_factory))):
        model = foveal.load(folder, pipelined=False)
        runner = model.family.runner
        runner.allocate_kv(128, PAGE)  # a private pool for the driver (the engine is idle)
        out[gelu] = (model, runner)
    yield out
    for model, _ in out.values():
        model.close()


@pytest.fixture(scope="module")
def runner(runners):
    return runners["exact"][1]


class Driver:
    """One sequence on the runner; its pages are 0.. in order, so a position's KV row is the position."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.pos = 0

    def run(self, ids: list[int], prefill=None) -> tuple[torch.Tensor, torch.Tensor]:
        n, start = len(ids), self.pos
        positions = torch.arange(start, start + n)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=positions,
            query_start=torch.tensor([0, n], dtype=torch.int32),
            context_lens=torch.tensor([start + n], dtype=torch.int32),
            block_tables=torch.arange(-(-(start + n) // PAGE), dtype=torch.int32)[None],
            kv_index=positions.clone(),
            max_query_len=n,
            max_context_len=start + n,
            prefill=[prefill] if prefill is not None else [],
        )
        logits = self.runner.forward(batch)[0]
        self.pos += n
        return logits, self.runner.last_hidden[0]

    def sample(self, logits, hidden, kind: int) -> int:
        sampled = logits.argmax()[None].clone()
        if kind:
            self.runner.sample_regions(hidden[None], torch.tensor([kind]), torch.tensor([0]), sampled)
        return int(sampled[0])


def x_of(runner, hidden) -> int:
    """The gate step's x once the object is decided: the region heads over the same hidden state."""
    sampled = torch.tensor([COORD_ID])
    runner.sample_regions(hidden[None], torch.tensor([GATE]), torch.tensor([0]), sampled)
    return int(sampled[0])


def close(got, ref, what):
    assert got.shape == ref.shape, what
    diff = float((got.float() - ref).abs().max())
    assert diff <= TOLERANCE, f"{what}: max diff {diff}"
    return diff


def image_of(md3_dir, name):
    return Image.open(md3_dir / "images" / f"{name}.png")


def prefill(runner, md3_dir, name, parts):
    driver = Driver(runner)
    processor = MoondreamProcessor(runner.config, None, runner.device, runner.dtype)
    inputs = processor(MoondreamPrompt(tuple(parts)), image_of(md3_dir, name) if name else None)
    return driver, *driver.run(inputs.token_ids, inputs.prefill)


def greedy(driver, logits, fig, step_logits=None, masked=(ANSWER,)):
    """The reference's text loop: first token unmasked, then `masked` ids at -inf; checks each step."""
    ids = [int(logits.argmax())]
    for step in range(len(fig["greedy_ids"]) - 1):
        raw, _ = driver.run([ids[-1]])
        assert driver.pos - 1 == fig["decode_steps"][step]["pos"]
        if step_logits is not None:
            close(raw, step_logits[step], f"decode step {step}")
        raw = raw.clone()
        raw[list(masked)] = float("-inf")
        top = raw.topk(5)
        assert top.indices.tolist() == fig["decode_steps"][step]["top5_ids"]
        assert np.allclose(top.values.tolist(), fig["decode_steps"][step]["top5_logits"], atol=TOLERANCE)
        ids.append(int(raw.argmax()))
    assert ids == fig["greedy_ids"]


# ---- vision ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGES)
def test_crops(md3_dir, name):
    fig = figures(md3_dir)["images"][name]["crops"]
    crops, tiling = vision.crops(image_of(md3_dir, name))
    assert list(tiling) == fig["tiling"]
    assert [hashlib.sha256(c.tobytes()).hexdigest() for c in crops] == fig["sha256_uint8_hwc"]
    for crop, file in zip(crops, fig["files"], strict=True):
        assert np.array_equal(crop, np.asarray(Image.open(md3_dir / file).convert("RGB")))


@pytest.mark.parametrize("name", IMAGES)
def test_vision_features(runner, md3_dir, name):
    ref = load_file(md3_dir / "figures.safetensors")
    crops, tiling = vision.crops(image_of(md3_dir, name))
    with torch.inference_mode():
        features = runner.vision.features(vision.normalize(crops))
        close(features[0], ref[f"{name}.vis_enc.global"], "global features")
        pooled = vision.pool_tiles(features[1:], tiling).view(27, 27, -1)
        close(pooled, ref[f"{name}.vis_enc.local_pooled"], "pooled tiles")
        close(runner.vision.project(features, tiling), ref[f"{name}.img_emb"], "image embeddings")


@pytest.mark.parametrize("name", IMAGES)
def test_prefix_hidden_rows(runner, md3_dir, name):
    """Hidden states of the BOS + image prefill at the recorded rows (bidirectional prefix, tau at positions 0..729)."""
    ref = load_file(md3_dir / "figures.safetensors")
    processor = MoondreamProcessor(runner.config, None, runner.device, runner.dtype)
    inputs = processor(MoondreamPrompt(()), image_of(md3_dir, name))
    n = len(inputs.token_ids)
    positions = torch.arange(n)
    batch = ForwardBatch(
        torch.tensor(inputs.token_ids), positions, torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32), torch.arange(-(-n // PAGE), dtype=torch.int32)[None],
        positions.clone(), n, n, [inputs.prefill],
    )  # fmt: skip
    kv = runner.kv
    ctx = build_context(batch, PagedKV(kv.k, kv.v, kv.page_size, kv.scratch_page), torch.tensor([730]))
    with torch.inference_mode():
        x = runner._scatter_images(runner.embed(batch.input_ids), batch, ctx.query_seq, [(0, inputs.prefill)])
        hidden = runner.text(x, positions, ctx, runner.cos, runner.sin)
    rows = figures(md3_dir)["images"][name]["vision"]["prefix_hidden_rows"]
    close(hidden[rows], ref[f"{name}.prefix_hidden.rows"], "prefix hidden rows")


# ---- text --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("task", ["caption_short", "caption_normal", "query"])
def test_text_answers(runners, md3_dir, gelu, name, task):
    which = "figures" if gelu == "exact" else "figures_tau_tanh"
    fig_all, ref = figures(md3_dir, which), load_file(md3_dir / f"{which}.safetensors")
    if task not in fig_all["images"][name]:
        pytest.skip(f"{which} does not record {task}")
    fig = fig_all["images"][name][task]
    driver, logits, hidden = prefill(runners[gelu][1], md3_dir, name, fig["prompt_ids"])
    assert driver.pos - len(fig["prompt_ids"]) == fig["prompt_start_pos"] == 730
    close(logits, ref[f"{name}.{task}.prompt_last_logits"], "prompt logits")
    close(hidden, ref[f"{name}.{task}.prompt_last_hidden"], "prompt hidden")
    greedy(driver, logits, fig, ref.get(f"{name}.{task}.step_logits"))


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_text_only_query(runners, md3_dir, gelu):
    which = "figures" if gelu == "exact" else "figures_tau_tanh"
    fig, ref = figures(md3_dir, which)["text_only"]["query"], load_file(md3_dir / f"{which}.safetensors")
    driver = Driver(runners[gelu][1])
    logits, hidden = driver.run(fig["prompt_ids"])
    close(logits, ref["text_only.query.prompt_last_logits"], "prompt logits")
    greedy(driver, logits, fig, ref.get("text_only.query.step_logits"))


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
@pytest.mark.parametrize("name", [*IMAGES, None])
def test_reasoning(runners, md3_dir, gelu, name):
    """The reasoning loop (eos and size masked after the first token, coordinates from the same hidden
    state) and the answer after it, whose prompt [3] follows the last fed token."""
    which = "figures" if gelu == "exact" else "figures_tau_tanh"
    fig_all, ref = figures(md3_dir, which), load_file(md3_dir / f"{which}.safetensors")
    fig = fig_all["text_only"].get("reasoning") if name is None else fig_all["images"][name]["reasoning"]
    if fig is None:
        pytest.skip(f"{which} records no text-only reasoning")
    key = "text_only.reasoning" if name is None else f"{name}.reasoning"
    runner = runners[gelu][1]
    if name is None:
        driver = Driver(runner)
        logits, hidden = driver.run(fig["prompt_ids"])
    else:
        driver, logits, hidden = prefill(runner, md3_dir, name, fig["prompt_ids"])
    close(logits, ref[f"{key}.prompt_last_logits"], "reasoning prompt logits")
    ids, step_logits = [int(logits.argmax())], []
    while ids[-1] != ANSWER and len(ids) < len(fig["reasoning_ids"]) + 1:
        if len(ids) == len(fig["reasoning_ids"]) and fig["reasoning_stop"] == "max_tokens":
            break
        fed = driver.sample(logits, hidden, 4) if ids[-1] == COORD_ID else ids[-1]
        logits, hidden = driver.run([fed])
        step_logits.append(logits)
        masked = logits.clone()
        masked[[EOS, SIZE_ID]] = float("-inf")
        ids.append(int(masked.argmax()))
    if fig["reasoning_stop"] == "max_tokens":  # the 12th token is fed, then the answer follows
        logits, hidden = driver.run([ids[-1]])
        step_logits.append(logits)
    assert ids[: len(fig["reasoning_ids"])] == fig["reasoning_ids"]
    recorded = ref.get(f"{key}.reasoning_step_logits")
    if recorded is not None:
        close(torch.stack(step_logits[: recorded.shape[0]]), recorded, "reasoning steps")
    logits, _ = driver.run([ANSWER])
    assert driver.pos - 1 == fig["answer"]["prompt_start_pos"]
    answer_logits = ref.get(f"{key}.answer_prompt_last_logits")
    if answer_logits is not None:
        close(logits, answer_logits, "answer prompt logits")
    greedy(driver, logits, fig["answer"])


# ---- region heads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("skill", ["detect", "point"])
def test_region_answers(runners, md3_dir, gelu, name, skill):
    """The reference's detect / point loop: gate, x, y, (size); later gates on the [coord, eos] rows only."""
    which = "figures" if gelu == "exact" else "figures_tau_tanh"
    fig, ref = figures(md3_dir, which)["images"][name][skill], load_file(md3_dir / f"{which}.safetensors")
    runner = runners[gelu][1]
    with_size = skill == "detect"
    driver, logits, hidden = prefill(runner, md3_dir, name, fig["prompt_ids"])
    close(hidden, ref[f"{name}.{skill}.prompt_last_hidden"], "prompt hidden")
    assert int(logits.argmax()) == fig["prompt_next_token"]
    coord_logits, size_logits, bins, sizes, positions, continues = [], [], [], [], [], []
    first = True
    for _ in range(fig["max_objects"]):
        if not first:  # the two-row head: coord if logit[coord] >= logit[eos]
            two = logits[[COORD_ID, EOS]]
            continues.append(COORD_ID if two[0] >= two[1] else EOS)
            if continues[-1] == EOS:
                break
        elif int(logits.argmax()) == EOS:
            break
        first = False
        with torch.inference_mode():
            coord_logits.append(runner.region.coord_logits(hidden[None])[0])
        value = x_of(runner, hidden)
        bins.append(value - runner.vocab_size)
        positions.append(driver.pos)
        logits, hidden = driver.run([value])
        with torch.inference_mode():
            coord_logits.append(runner.region.coord_logits(hidden[None])[0])
        value = driver.sample(logits, hidden, COORD)
        bins.append(value - runner.vocab_size)
        positions.append(driver.pos)
        logits, hidden = driver.run([value])
        if with_size:
            with torch.inference_mode():
                size_logits.append(runner.region.size_logits(hidden[None])[0])
            value = driver.sample(logits, hidden, SIZE)
            sizes.append(divmod(value - runner.vocab_size - 1024, 1024))
            positions.append(driver.pos)
            logits, hidden = driver.run([value])
    assert bins == [step["argmax"] for step in fig["coord_steps"]]
    assert sizes == [(step["w_bin"], step["h_bin"]) for step in fig.get("size_steps", [])]
    assert positions == fig["decode_positions"]
    decided = [step["decision"] for step in fig["continue_steps"] if step["decides"]]
    assert [0 if c == EOS else 1 for c in continues] == [0 if d == EOS else 1 for d in decided]
    close(torch.stack(coord_logits), ref[f"{name}.{skill}.coord_logits"], "coordinate logits")
    if with_size:
        close(torch.stack(size_logits), ref[f"{name}.{skill}.size_logits"], "size logits")


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("case", ["point", "box", "point_and_box"])
def test_spatial_refs(runner, md3_dir, name, case):
    fig = figures(md3_dir)["images"][name][f"spatial_refs_{case}"]
    ref = load_file(md3_dir / "figures.safetensors")
    parts: list = []
    for r in fig["spatial_refs"]:
        if len(r) == 2:
            parts += [Coord(r[0]), Coord(r[1])]
        else:
            parts += [Coord((r[0] + r[2]) / 2), Coord((r[1] + r[3]) / 2), Size(r[2] - r[0], r[3] - r[1])]
    prompt = fig["prompt_ids"]
    coords, size_at = fig["coord_token_positions"], fig["size_token_positions"]
    head, tail = prompt[: min(coords)], prompt[max(coords + size_at) + 1 :]
    driver, logits, hidden = prefill(runner, md3_dir, name, [*head, *parts, *tail])
    with torch.inference_mode():
        coord_values = torch.tensor([p.value for p in parts if isinstance(p, Coord)])
        close(runner.region.encode_coord(coord_values), ref[f"{name}.spatial_refs_{case}.ref_coord_emb"], "refs")
    close(logits, ref[f"{name}.spatial_refs_{case}.prompt_last_logits"], "prompt logits")
    greedy(driver, logits, fig)


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("k", [0, 1])
def test_detect_gaze(runner, md3_dir, name, k):
    fig = figures(md3_dir)["images"][name][f"detect_gaze_{k}"]
    ref = load_file(md3_dir / "figures.safetensors")
    x, y = fig["eye_as_bfloat16"]
    driver, logits, hidden = prefill(runner, md3_dir, name, [10, Coord(x), Coord(y), 10])
    close(logits, ref[f"{name}.detect_gaze_{k}.prompt_last_logits"], "gaze prompt logits")
    assert (int(logits.argmax()) == EOS) == fig["first_is_eos"]


def test_figures_cover_every_image(md3_dir):
    assert set(figures(md3_dir)["images"]) == set(IMAGES)
    assert json.loads((md3_dir / "config.json").read_text())["config"]["text"]["moe"]
