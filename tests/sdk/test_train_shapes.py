"""Smoke test and invariants of foveal.train_shapes (tiny config, a few steps, seconds)."""

import json

import numpy as np
import pytest
import torch

from foveal import train_shapes as ts
from foveal.shapes_format import ShapesFormat
from foveal.vision import scenes

TINY = {
    "batch_size": 4,
    "image_size": 32,
    "patch_size": 8,
    "vision_width": 64,
    "vision_layers": 1,
    "text_width": 64,
    "text_layers": 1,
    "warmup": 2,
    "steps": 4,
}


@pytest.fixture(scope="module")
def tiny_cfg():
    return ts.TrainConfig(**TINY)


def _weights(trainer):
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_few_steps_lower_the_loss_on_a_fixed_batch(tiny_cfg):
    trainer = ts.Trainer(tiny_cfg)
    losses = []
    for _ in range(4):
        trainer.step = 0  # the batch of a step is fixed: step 0 again and again
        losses.append(trainer.train_step())
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]


def test_same_seed_same_weights(tiny_cfg):
    a, b = ts.Trainer(tiny_cfg), ts.Trainer(tiny_cfg)
    for _ in range(2):
        a.train_step()
        b.train_step()
    assert torch.equal(_weights(a), _weights(b))
    other = ts.Trainer(ts.TrainConfig(**{**TINY, "seed": 1}))
    other.train_step()
    other.train_step()
    assert not torch.equal(_weights(a), _weights(other))


def test_resume_equals_uninterrupted(tiny_cfg, tmp_path):
    straight = ts.Trainer(tiny_cfg)
    for _ in range(3):
        straight.train_step()
    first = ts.Trainer(tiny_cfg)
    for _ in range(2):
        first.train_step()
    first.save_checkpoint(tmp_path / "last.pt")
    torch.manual_seed(1234)  # a resumed process starts with some other RNG state
    resumed = ts.Trainer(tiny_cfg)
    resumed.load_checkpoint(tmp_path / "last.pt")
    assert resumed.step == 2
    resumed.train_step()
    assert torch.equal(_weights(straight), _weights(resumed))


def test_cli_trains_resumes_and_exports(tmp_path):
    run = tmp_path / "run"
    ts.main(["--run", str(run), "--steps", "2", "--config", json.dumps(TINY), "--log-every", "1"])
    ts.main(["--run", str(run), "--steps", "3", "--log-every", "1", "--export", str(tmp_path / "hf")])
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "preprocessor_config.json",
        "foveal.json",
    } <= names


def test_training_ids_equal_the_processor_ids(tiny_cfg, tmp_path):
    from transformers import PaliGemmaProcessor

    trainer = ts.Trainer(tiny_cfg)
    folder = trainer.export(tmp_path / "hf")
    processor = PaliGemmaProcessor.from_pretrained(folder)
    assert len(processor.tokenizer) == len(trainer.tok)  # nothing added on load: embeddings fit
    rng = np.random.default_rng(0)
    for _ in range(6):
        ex = ts.sample_example(rng, tiny_cfg, trainer.fmt)
        ids, n_prefix = ts.encode_example(trainer.tok, ex.prompt, ex.target, trainer.n_image_tokens)
        got = processor(images=scenes.render(ex.scene), text="<image>" + ex.prompt, suffix=ex.target)
        assert got["input_ids"][0] == ids
        assert got["token_type_ids"][0] == [0] * n_prefix + [1] * (len(ids) - n_prefix)
        pixels = ts.pixel_tensor(scenes.render(ex.scene), tiny_cfg.image_size)
        ref = processor.image_processor(scenes.render(ex.scene), return_tensors="pt")["pixel_values"][0]
        assert torch.allclose(pixels, ref, atol=2 / 255)


def test_training_seeds_are_disjoint_from_evaluation(tiny_cfg):
    from foveal.eval_shapes import eval_scene

    rng = np.random.default_rng(0)
    fmt = ShapesFormat(n_bins=tiny_cfg.n_bins)
    assert all(ts.sample_example(rng, tiny_cfg, fmt).scene.seed >= ts.TRAIN_SEED_BASE for _ in range(50))
    assert eval_scene(499).seed < ts.TRAIN_SEED_BASE


def test_soft_location_targets_cost_less_for_near_misses(tiny_cfg):
    loc_ids = torch.arange(10, 10 + tiny_cfg.n_bins)
    labels = torch.tensor([[-100, 10 + 5]])

    def loss_for(predicted_bin):
        logits = torch.full((1, 2, 10 + tiny_cfg.n_bins), -10.0)
        logits[0, 0, 10 + predicted_bin] = 10.0
        return ts.loss_fn(logits, labels, loc_ids, tiny_cfg)

    assert loss_for(5) < loss_for(6) < loss_for(9)
