"""Smoke test and invariants of foveal.training.train_shapes (tiny config, a few steps, seconds)."""

import json

import numpy as np
import pytest
import torch

from foveal.families.shapes.format import ShapesFormat
from foveal.training import train_shapes as ts
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
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= ts.EXPORTED_FILES
    tokenizer_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(tokenizer_config)  # how the run loaded it is not shipped


def test_a_warm_started_run_resumes_after_its_source_is_gone(tmp_path):
    source = ts.Trainer(ts.TrainConfig(**TINY)).export(tmp_path / "source")
    run, warm = tmp_path / "run", {**TINY, "init_from": str(source)}
    ts.main(["--run", str(run), "--steps", "1", "--config", json.dumps(warm)])
    for p in source.iterdir():
        p.unlink()  # e.g. an exported folder replaced since; the run's checkpoint holds the weights
    ts.main(["--run", str(run), "--steps", "2", "--log-every", "1"])
    assert json.loads((run / "log.jsonl").read_text().splitlines()[-1])["step"] == 2


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
    from foveal.training.eval_shapes import eval_scene

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


# ---- task formats (foveal.families.shapes.format) -------------------------------------------------------


def test_location_bins_encode_and_decode():
    fmt = ShapesFormat(n_bins=32)
    assert fmt.locations.encode(0.0) == 0 and fmt.locations.encode(1.0) == 31 and fmt.locations.encode(0.5) == 16
    assert fmt.locations.decode(31) == 1.0
    assert all(fmt.locations.encode(fmt.locations.decode(k)) == k for k in range(32))


def test_detect_and_point_targets_parse_back_to_the_ground_truth():
    fmt = ShapesFormat(n_bins=32)
    for seed in range(100):
        scene = scenes.generate_scene(seed, 90)
        truth = [o.box(90, 90) for o in scenes.objects_matching(scene, "shape")]
        target = fmt.detect_target(scene, "shape")
        boxes = fmt.parse_detect(target)
        assert len(boxes) == len(truth)
        for b, (x0, y0, x1, y1) in zip(boxes, truth, strict=True):
            assert b["x_min"] < b["x_max"] and b["y_min"] < b["y_max"]  # the grammar's rule
            got = (b["x_min"], b["y_min"], b["x_max"], b["y_max"])
            assert max(abs(g - t) for g, t in zip(got, (x0, y0, x1, y1), strict=True)) <= 0.5 / 31 + 1e-9
        points = fmt.parse_point(fmt.point_target(scene, "shape"))
        objs = scenes.objects_matching(scene, "shape")
        assert len(points) == len(objs)
        assert all(o.contains(p["x"], p["y"], 90, 90) for o, p in zip(objs, points, strict=True))
        assert target.count(" ; ") == len(truth) - 1 and target.endswith(" shape")
    assert fmt.detect_target(scenes.Scene(0, 64, 64, 230, ()), "circle") == ""


def test_boxes_keep_positive_extent_in_bins():
    fmt = ShapesFormat(n_bins=8)
    assert fmt.locations.box_bins((0.50, 0.50, 0.52, 0.52)) == (4, 4, 5, 5)
    assert fmt.locations.box_bins((0.99, 0.99, 1.0, 1.0)) == (6, 6, 7, 7)


def test_format_file_round_trips(tmp_path):
    fmt = ShapesFormat(n_bins=24)
    fmt.save(tmp_path)
    assert ShapesFormat.load(tmp_path) == fmt
    assert fmt.prompt("detect", object="red circle") == "detect red circle"
    with pytest.raises(FileNotFoundError, match="train one"):
        ShapesFormat.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="use one of"):
        fmt.prompt("segment", object="x")


def test_detect_and_point_targets_are_accepted_by_the_spatial_grammar():
    from foveal import grammars
    from foveal.grammars import spatial

    fmt = ShapesFormat(n_bins=32)
    tok = ts.build_tokenizer(fmt)
    for seed in range(20):
        scene = scenes.generate_scene(seed, 80)
        for phrase in ("shape", "circle", "red circle"):
            for spec, text in (
                (spatial.boxes("loc", label=phrase, bins=32), fmt.detect_target(scene, phrase)),
                (spatial.points("loc", label=phrase, bins=32), fmt.point_target(scene, phrase)),
            ):
                matcher = grammars.compile(spec, tok).matcher()
                for token_id in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]:
                    matcher.commit(token_id)  # raises on a token the grammar forbids
                assert matcher.is_terminated(), text


def test_patch_targets_label_every_object_with_its_colour_shape_box_and_one_centre():
    for seed in range(50):
        scene = scenes.generate_scene(seed, 96)
        colour, shape, box, centre = ts.patch_targets(scene, 8)
        cells = {
            min(int(o.centre(96, 96)[1] * 8), 7) * 8 + min(int(o.centre(96, 96)[0] * 8), 7)
            for o in scene.objects
        }
        assert centre.sum() == len(cells)  # one flag per object (two small neighbours may share a cell)
        assert set(colour.tolist()) <= {0} | {1 + list(scenes.COLOURS).index(o.colour) for o in scene.objects}
        for o in scene.objects:
            cx, cy = o.centre(96, 96)
            k = min(int(cy * 8), 7) * 8 + min(int(cx * 8), 7)
            assert colour[k] == 1 + list(scenes.COLOURS).index(o.colour)
            assert shape[k] == 1 + scenes.SHAPES.index(o.shape)
            assert torch.allclose(box[k], torch.tensor(o.box(96, 96)))
            assert centre[k] == 1.0
        assert ((colour == 0) == (shape == 0)).all() and (box[colour == 0] == 0).all()


def test_warm_start_from_an_exported_folder_gives_the_exported_weights(tiny_cfg, tmp_path):
    trained = ts.Trainer(tiny_cfg)
    trained.train_step()
    trained.export(tmp_path / "hf")  # bf16, no auxiliary head: what sdk/embedded holds
    warm = ts.Trainer(ts.TrainConfig(**{**TINY, "init_from": str(tmp_path / "hf")}))
    expected = {k: v.to(torch.bfloat16).float() for k, v in trained.model.state_dict().items()}
    for name, value in warm.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
