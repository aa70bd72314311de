"""Which Moondream 2 revision a folder holds, and refusing the revisions foveal does not implement.

PROBLEM
    The 2025-01-09, 2025-03-27, 2025-04-14 and 2025-06-21 revisions of `vikhyatk/moondream2` share
    their tensor names, so every one loads, but their tokenizer, special ids, templates and prompt
    rules differ (the reference resets the nested config to each revision's own defaults). Reading
    an older revision with the 2025-06-21 ("starmie") rules answers wrongly without a word.
SOLUTION
    `detect(folder)` reads, without running anything: the Hugging Face cache's refs (a snapshot
    folder `.../snapshots/<commit>` is named by the refs whose content is that commit, e.g.
    `refs/2025-06-21`), and the folder's remote-code `config.py` (the revision's tokenizer
    defaults: the starmie revision's names `moondream/starmie-v1`). `check(folder, config_entry)`
    refuses a folder whose revision is known not to be the implemented one, naming what it found
    and what is supported. A folder with a filled `config` entry states its own ids and templates
    (the fixture's), and is taken as written.
MOONDREAM 3
    Moondream 3's checkpoints are told apart by their tensors, not their revision names (the preview's
    Hugging Face repository has one implemented revision, whose config.json says no more than
    Moondream 2's). `check3(folder, names)` names the layout a folder holds:
        "preview"    the Hugging Face layout of moondream/moondream3-preview (`model.text.blocks.*`
                     with `attn.tau.*` and `mlp.router`), no region LayerNorm (the fixture's);
        "region-ln"  the same layout with `model.region.ln` (a LayerNorm before both region decoders:
                     later checkpoints, as Moondream's engine since 2026-01 and the vLLM / MLX ports
                     read them), loaded and applied (load.py, region.py).
    and refuses Moondream's engine's (kestrel's) training layout, that of moondream3.1-9B-A2B's
    `model.safetensors` and of the preview's `model_fp8.pt` (`text_model.transformer.h.*` with
    `tau_wq` / `tau_wqwv`, `gate`, FP8 `mlp.experts`; `region_model.*`), naming the tensors and file
    it found: foveal does not map it (its FP8 experts and row interleaving are another format).
    Moondream 2's 2024 layout (`text_model.*` without tau or experts) is not Moondream 3's and is left
    to Moondream 2's checks.
INVARIANTS
    - Nothing from the folder is executed; config.py is only searched as text.
    - A folder is never read with rules it is known not to follow.
    - Every check runs on tensor names and headers, before any weight is read.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

from foveal.engine.models.arch import ModelLoadError

SUPPORTED = ("2025-06-21",)  # the starmie tokenizer era (the reference at the fixture's commit)
STARMIE_MARK = "starmie"


def cache_refs(folder: Path) -> list[str]:
    """The hub-cache ref names (branches, tags) that point at this snapshot folder, if it is one."""
    folder = folder.resolve()
    if folder.parent.name != "snapshots":
        return []
    refs = folder.parent.parent / "refs"
    if not refs.is_dir():
        return []
    return sorted(
        str(ref.relative_to(refs)) for ref in refs.rglob("*") if ref.is_file() and ref.read_text().strip() == folder.name
    )


def _is_dated(name: str) -> bool:
    """A revision named as the model's releases are (YYYY-MM-DD)."""
    parts = name.split("-")
    return len(parts) == 3 and all(p.isdigit() for p in parts) and len(parts[0]) == 4


def detect(folder: Path) -> tuple[str | None, str]:
    """(the revision's name if the folder says it, what was found, for messages)."""
    refs = [ref for ref in cache_refs(folder) if ref != "main"]
    dated = [ref for ref in refs if ref[:4].isdigit()]
    code = folder / "config.py"
    if dated:
        return dated[-1], f"hub cache ref {dated[-1]}"
    if code.is_file():
        starmie = STARMIE_MARK in code.read_text(errors="replace")
        found = "remote code naming the starmie tokenizer" if starmie else "remote code of a pre-starmie revision"
        return (SUPPORTED[-1] if starmie else "older than 2025-06-21"), found
    return None, "no revision information"


def check(folder: Path, config_entry: dict | None, pinned: str | None = None) -> str | None:
    """The folder's revision (None when it does not say), after refusing one foveal does not implement,
    or one that differs from `pinned`."""
    revision, found = detect(folder)
    dated = pinned is not None and _is_dated(pinned)
    if dated and pinned not in SUPPORTED:
        raise ModelLoadError(
            f"Moondream 2 revision {pinned!r} is not implemented; foveal supports {', '.join(SUPPORTED)}"
        )
    # a pinned commit or branch selected the snapshot (hub.resolve_hub_id); its own refs say which dated
    # revision it is, and the rules below refuse one foveal does not implement
    if dated and revision is not None and revision != pinned:
        raise ModelLoadError(f"{folder} holds Moondream 2 revision {revision} ({found}), not the pinned {pinned!r}")
    if config_entry:  # the folder states its own ids and templates
        return revision
    if revision is not None and revision not in SUPPORTED:
        raise ModelLoadError(
            f"{folder} holds Moondream 2 revision {revision} ({found}); its tokenizer, special ids and prompt "
            f"templates differ from the ones foveal implements ({', '.join(SUPPORTED)}): download revision "
            f"{SUPPORTED[-1]} (revision='{SUPPORTED[-1]}')"
        )
    return revision


# Tensors only Moondream 3's training layout has (kestrel's weights.py): tau, the router ("gate") and
# the expert stacks of `text_model.transformer.h.{i}`.
TRAINING_MD3 = re.compile(
    r"text_model\.transformer\.h\.\d+\.(tau_wq|tau_wv|tau_wqwv|tau_alpha|gate\.weight|mlp\.(output_)?experts\.weight)"
)
# (the preview's model_fp8.pt, a pickled file, never reaches this check: foveal's loader refuses
# pickled weights before any family reads the folder)
FP8_FILE = "model_fp8.pt"
PREVIEW_LAYOUT = "moondream/moondream3-preview's Hugging Face layout (model.safetensors: model.text.blocks.* ...)"


def check3(folder: Path, names: list[str]) -> str | None:
    """The Moondream 3 layout of a checkpoint's tensor names ("preview" or "region-ln"), None where they
    are no Moondream 3 layout; kestrel's training layout is refused (see the module docstring)."""
    training = sorted(n for n in names if TRAINING_MD3.fullmatch(n))
    if training:
        raise ModelLoadError(
            f"{folder} holds Moondream 3 weights in Moondream's engine's (kestrel's) training layout "
            f"({_training_found(folder, names, training)}), the layout of moondream3.1-9B-A2B's model.safetensors "
            f"and of the preview's {FP8_FILE}; foveal does not map it: download {PREVIEW_LAYOUT}"
        )
    if not any(".attn.tau." in n or ".mlp.router." in n for n in names):
        return None
    return "region-ln" if "model.region.ln.weight" in names else "preview"


def _training_found(folder: Path, names: list[str], training: list[str]) -> str:
    """What a training-layout file holds, for the refusal: a few of its Moondream 3 tensors, the experts'
    dtype as its header states it, and whether it has the region LayerNorm."""
    found = f"e.g. {', '.join(training[:3])}"
    experts = next((n for n in training if n.endswith(".mlp.experts.weight")), None)
    dtype = _stored_dtype(folder, experts) if experts else None
    if dtype:
        found += f"; experts stored as {dtype}"
    if any(n.startswith("region_model.ln.") for n in names):
        found += "; with region_model.ln"
    return found


def _stored_dtype(folder: Path, name: str) -> str | None:
    """A tensor's dtype from its safetensors header (model.safetensors or a shard), None if unreadable."""
    from .weights import tensor_files  # weights imports the model modules; only refusals need it

    try:
        path = tensor_files(folder)[name]
        with safe_open(str(path), framework="pt") as file:
            return str(file.get_slice(name).get_dtype())
    except Exception:  # the refusal names the tensors either way
        return None
