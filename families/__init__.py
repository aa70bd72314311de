"""Model families as plugins: one folder per family, and the registry that maps a checkpoint to its family.

Each family (`base.Family`) owns everything foveal knows of its checkpoints: how they load onto the
engine's building blocks (runner, processor), how each skill asks them and reads their answer, their
answer automata and mask policy, and what they declare they can do (`Capabilities`). The SDK asks the
loaded model's family and never names one; the engine is generic and names none either.

    family = foveal.families.load("/path/to/checkpoint")   # the family's plugin, its checkpoint loaded
    family.capabilities.skills                             # frozenset({"caption", "query", ...})
    task = family.detect("red circle", max_objects=10)     # prompt + output spec + parser

Adding a family: a new folder here with a `Family` subclass (`matches` and `load` for the registry,
the skills it declares), and one line in `_REGISTRY`. Order matters where two families match one
folder: the more specific comes first (the shapes model is a PaliGemma folder with a foveal.json).

Families: Moondream 2 (`moondream/`, foveal's own implementation), the embedded shapes model
(`shapes/`), PaliGemma (`paligemma/`), Qwen2.5-VL and Qwen3-VL (`qwen_vl/`), Qwen3.5 (`qwen3_5/`),
Gemma 4 (`gemma4/`), Molmo 2 (`molmo2/`), and chat / instruct models on transformers' modules:
Llama-style and Gemma text models, Idefics3 / SmolVLM, LLaVA (`chat/`, also llama .gguf files).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.families")

from importlib import import_module  # noqa: E402

from foveal.engine.models.arch import ModelLoadError  # noqa: E402
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES  # noqa: E402
from foveal.engine.models.loader import LoadOptions, read_config, resolve_options, resolve_source  # noqa: E402
from foveal.families.base import Capabilities, Family, UnsupportedSkill  # noqa: E402
from foveal.families.chat import ChatFamily  # noqa: E402

# The registry in match order: family class -> its folder's module. The other families are imported
# on first use (`FAMILIES`, `family_for`, `foveal.families.QwenVLFamily`): their modules import
# transformers' modeling code and image processors, seconds that a .gguf load (ChatFamily only) and
# `import foveal.families` need not pay.
_REGISTRY = (
    ("MoondreamFamily", "foveal.families.moondream"),
    ("ShapesFamily", "foveal.families.shapes"),
    ("PaliGemmaFamily", "foveal.families.paligemma"),
    ("QwenVLFamily", "foveal.families.qwen_vl"),
    ("Qwen35Family", "foveal.families.qwen3_5"),
    ("Gemma4Family", "foveal.families.gemma4"),
    ("Molmo2Family", "foveal.families.molmo2"),
    ("ChatFamily", "foveal.families.chat"),
)
_MODULES = dict(_REGISTRY)
_FAMILIES: list[tuple[type[Family], ...]] = []  # FAMILIES, once imported


def registered() -> tuple[type[Family], ...]:
    """Every family in match order (`FAMILIES`), imported on the first call."""
    if not _FAMILIES:
        _FAMILIES.append(tuple(getattr(import_module(module), cls) for cls, module in _REGISTRY))
    return _FAMILIES[0]


def __getattr__(name: str) -> Any:
    """`FAMILIES` and each family's class by name, imported on first use."""
    if name == "FAMILIES":
        return registered()
    if name in _MODULES:
        return getattr(import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_architectures() -> list[str]:
    return list(dict.fromkeys(arch for family in registered() for arch in family.architectures))


def family_for(raw: dict, folder: Path) -> type[Family]:
    """The family that loads the folder whose config.json is `raw`; ModelLoadError with the supported list."""
    for family in registered():
        if family.matches(raw, folder):
            return family
    raise ModelLoadError(
        f"unsupported architecture {raw.get('architectures')!r}; foveal supports: "
        f"{', '.join(supported_architectures())}. Use a checkpoint of one of these, or add a family in "
        "foveal/families (a folder with a Family subclass and one line in _REGISTRY)."
    )


def load(
    source: str | os.PathLike,
    device: Any = "auto",
    dtype: Any = None,
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
    quantize: str | None = None,
    image_options: dict[str, Any] | None = None,
    revision: str | None = None,
    runner: str = "auto",
) -> Family:
    """Load a checkpoint as its family's plugin. `source`: a local Hugging Face folder (safetensors), a hub id
    already in the local cache, or a .gguf file. Options as `foveal.load`'s; all are checked before any
    weights are read. `revision` pins a hub id's snapshot; on a local folder only a family that can
    tell a folder's revision (`Family.checks_revision`) takes it, and checks it."""
    gguf = Path(str(source)).suffix == ".gguf"
    options = resolve_options(
        device, dtype, image_cache_bytes, quantize, image_options, gguf=gguf, revision=revision, runner=runner
    )
    path = resolve_source(source, revision)
    if gguf:
        return ChatFamily.load_gguf(path, options)
    raw = read_config(path)
    kind = family_for(raw, path)
    if revision is not None and Path(str(source)).exists() and not kind.checks_revision:
        raise ModelLoadError(
            f"revision={revision!r} cannot be checked on the local folder {source} ({kind.name} folders do not "
            "say their revision); pass the hub id with revision=, or load the folder without it"
        )
    family = kind.load(path, raw, options)
    family.source = str(source)  # as the caller named it (a hub id stays a hub id)
    return family


__all__ = [
    "FAMILIES",
    "Capabilities",
    "Family",
    "LoadOptions",
    "ModelLoadError",
    "UnsupportedSkill",
    "family_for",
    "load",
    "supported_architectures",
]
