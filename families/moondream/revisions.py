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
INVARIANTS
    - Nothing from the folder is executed; config.py is only searched as text.
    - A folder is never read with rules it is known not to follow.
"""

from __future__ import annotations

from pathlib import Path

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
