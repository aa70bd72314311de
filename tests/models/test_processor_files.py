"""Folders as transformers 5 saves them: the image processor nested in processor_config.json, with no
preprocessor_config.json beside it, load as the classic layout does, for every vision family."""

import json
import shutil

import pytest
import torch

from foveal.engine.models import ModelLoadError
from foveal.families import load
from foveal.testing import tiny, tiny_gemma4, tiny_molmo2

BUILDERS = {
    **{name: tiny.BUILDERS[name] for name in ("paligemma", "llava", "idefics3", "qwen2_5_vl")},
    "gemma4": tiny_gemma4.build_gemma4,
    "molmo2": tiny_molmo2.build_molmo2,
}
PROMPTS = {"gemma4": tiny_gemma4.prompts, "molmo2": tiny_molmo2.prompts}


def nested_layout(folder):
    """The folder with its image processor's settings moved into processor_config.json's
    `image_processor` entry, as ProcessorMixin.save_pretrained writes them in transformers 5."""
    alone = folder / "preprocessor_config.json"
    joint = folder / "processor_config.json"
    processor = json.loads(joint.read_text()) if joint.is_file() else {}
    if alone.is_file():
        processor.setdefault("image_processor", json.loads(alone.read_text()))
        alone.unlink()
    assert "image_processor" in processor
    joint.write_text(json.dumps(processor, indent=2))
    return folder


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_image_processor_nested_in_processor_config_loads_as_the_classic_layout(family, tmp_path):
    classic = BUILDERS[family](tmp_path / "classic")
    nested = nested_layout(shutil.copytree(classic, tmp_path / "nested"))
    assert not (nested / "preprocessor_config.json").exists()
    prompts = PROMPTS.get(family, tiny.family_prompts)
    a, b = load(classic, device="cpu"), load(nested, device="cpu")
    for x, y in zip(prompts(a), prompts(b), strict=True):
        assert x.token_ids == y.token_ids
        assert (x.prefill is None) == (y.prefill is None)
        if x.prefill is not None:
            assert x.prefill.image_tensors.keys() == y.prefill.image_tensors.keys()
            assert all(torch.equal(v, y.prefill.image_tensors[k]) for k, v in x.prefill.image_tensors.items())


def test_a_folder_with_neither_file_names_both(tmp_path):
    folder = nested_layout(tiny.BUILDERS["llava"](tmp_path / "llava"))
    settings = json.loads((folder / "processor_config.json").read_text())
    del settings["image_processor"]
    (folder / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelLoadError, match="preprocessor_config.json, or processor_config.json with an image_processor"):
        load(folder, device="cpu")
