"""Hub ids ("org/name") resolved to a local folder through huggingface_hub's cache.

The cache is read first (no network). When it has no copy, the folder is downloaded (safetensors,
JSON and tokenizer files only: pickled weights are never fetched); offline, or when the download
fails, the error names the command that fetches the folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from foveal.engine.models.arch import ModelLoadError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not os.path.exists(name)


def resolve_hub_id(
    repo_id: str, cache_dir: str | Path | None = None, revision: str | None = None
) -> Path:
    """The snapshot folder of `repo_id` (at `revision`: a branch, tag or commit; None: the default
    branch) in the hub cache, downloading it when online and not cached."""
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    how = (
        f"fetch it on a machine with network access: `{fetch}` (huggingface_hub's CLI), "
        "then copy the cache (HF_HUB_CACHE) here, or pass the path of a local checkpoint folder"
    )
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(f"{repo_id!r}{at} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {how}")
    try:
        return Path(
            snapshot_download(repo_id, cache_dir=cache_dir, revision=revision, allow_patterns=ALLOW_PATTERNS)
        )
    except Exception as exc:  # network, auth, missing repo: one message that says what to do
        raise ModelLoadError(f"could not download {repo_id!r} ({type(exc).__name__}: {exc}); {how}") from exc
