"""The shipped embedded model (sdk/embedded/): a normal Hugging Face folder that really answers.

Checks the folder's form (files, size, tokenizer/format agreement, loadable by transformers) and its
quality on 50 held-out scenes through the product's own path: `foveal.load()` with no argument and
`Model.detect` (engine, grammar-constrained), with issue 6's floor of 0.8 detect recall.
"""

import json
from pathlib import Path

import pytest

import foveal
from foveal.families.shapes.format import ShapesFormat
from foveal.training import eval_shapes
from foveal.training.train_shapes import EXPORTED_FILES
from foveal.vision import scenes

EMBEDDED = Path(foveal.__file__).parent / "embedded"
shipped = pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(),
    reason="no weights in sdk/embedded (export them with python -m foveal.training.train_shapes --run RUN "
    "--export sdk/embedded)",
)


@shipped
def test_folder_is_a_small_hugging_face_checkpoint():
    assert {p.name for p in EMBEDDED.iterdir()} >= EXPORTED_FILES
    assert sum(p.stat().st_size for p in EMBEDDED.iterdir()) <= 25 * 2**20
    assert json.loads((EMBEDDED / "config.json").read_text())["model_type"] == "paligemma"


@shipped
def test_tokenizer_has_the_location_tokens_of_the_format():
    from transformers import PaliGemmaProcessor

    fmt = ShapesFormat.load(EMBEDDED)
    processor = PaliGemmaProcessor.from_pretrained(EMBEDDED)
    ids = processor.tokenizer.convert_tokens_to_ids(fmt.locations.tokens())
    assert ids == list(range(ids[0], ids[0] + fmt.n_bins))  # contiguous, as the grammar may assume
    config = json.loads((EMBEDDED / "config.json").read_text())
    assert len(processor.tokenizer) <= config["text_config"]["vocab_size"]


@shipped
def test_detect_recall_on_50_held_out_scenes_through_foveal_load():
    import foveal

    scene_list = [eval_shapes.eval_scene(seed) for seed in range(50)]
    tasks = [eval_shapes.eval_tasks(s, i) for i, s in enumerate(scene_list)]
    found = total = 0
    with foveal.load() as model:
        assert Path(model.family.source) == EMBEDDED
        for scene, task in zip(scene_list, tasks, strict=True):
            boxes = model.detect(scenes.render(scene), task["phrase"])["objects"]
            truth = [o.box(scene.width, scene.height) for o in scenes.objects_matching(scene, task["phrase"])]
            matched, _ = eval_shapes.match_boxes(boxes, truth)
            found, total = found + matched, total + len(truth)
    assert found / total >= 0.8, f"detect recall {found / total:.3f} < 0.8 on 50 held-out scenes"
