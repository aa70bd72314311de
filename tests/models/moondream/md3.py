"""Helpers of the Moondream 3 fixture tests: the recorded figures, the images, the tanh-GELU and skills folders."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

IMAGES = ("shapes_320x240", "wide_1000x450", "tall_90x160")
TOLERANCE = 1e-4  # the fixture README's absolute rule for float32 (tells the two tau GELUs apart)


@functools.cache
def figures(folder: Path, which: str = "figures") -> dict:
    return json.loads((folder / f"{which}.json").read_text())


def tanh_folder(md3_dir: Path, factory) -> Path:
    """The fixture's folder with config.text.tau_gelu = "tanh" (the weights linked, not copied)."""
    folder = factory.mktemp("moondream3-tanh")
    raw = json.loads((md3_dir / "config.json").read_text())
    raw["config"]["text"]["tau_gelu"] = "tanh"
    (folder / "config.json").write_text(json.dumps(raw))
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(md3_dir / name)
    return folder


def skills_folder(md3_dir: Path, factory) -> Path:
    """The fixture's folder with the skills weights: lm_head replaced by skills_lm_head.safetensors."""
    folder = factory.mktemp("moondream3-skills")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(md3_dir / name, folder / name)
    state = load_file(md3_dir / "model.safetensors")
    state.update(load_file(md3_dir / "skills_lm_head.safetensors"))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
