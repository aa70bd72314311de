"""A persistent cache of a GGUF file's prepared weights and tokenizer, so a fresh process does not prepare them again.

PROBLEM
    Loading a GGUF file prepares its weights for foveal's kernels (gguf.py: Q4 blocks unpacked into
    the int4 kernel's layout, every weight fbgemm packs dequantized to float32) and converts its
    tokenizer (transformers' GGUF conversion, whose import scans transformers' model registry). A
    fresh process does all of it again for the same file: about half of a load's CPU time.

SOLUTION
    After a load built them, the parts of every prepared weight (`gguf.prepare`: int4 / int8
    buffers, the fp16 weight a HalfLinear packs) are written to one safetensors file,
    `<root>/prepared/<name>.safetensors`, where the root is `$FOVEAL_CACHE` or `~/.cache/foveal`
    (the folder foveal's test models use), and the tokenizer's `tokenizers` JSON beside it
    (`<name>.tokenizer.json`: transformers builds a tokenizer from a file without the deep copy it
    makes of a tokenizer object), the settings it was built with in the
    entry's metadata. A later load opens the entry memory-mapped, checks it and builds the layers
    from it; fbgemm's fp16 pack is an opaque object, so it is built again from the fp16 weight
    (most of what a hit still costs).
    `FOVEAL_WEIGHT_CACHE=0` turns the cache off (nothing read or written).

INVARIANTS
    - An entry is used only for the file and the build it was made from: its key (`key`) holds the
      file's resolved path, size, mtime and a CRC32 of its header, the load's dtype and quantize mode,
      torch's version and CPU capability (the int4 layout depends on them), transformers' and
      tokenizers' versions (the tokenizer), and `FORMAT`. Any difference: a silent miss, and the
      load writes a new entry in its place.
    - Every tensor's CRC32 is checked before it is used; an entry that is unreadable, incomplete or
      fails a check raises `Corrupt` (the loader warns and builds from the file), so a damaged entry
      never gives wrong weights.
    - Written atomically (a temporary file in the same folder, then `os.replace`; the tokenizer's
      file first, the entry, which holds its CRC32, last): a reader sees a whole old entry, a whole
      new one, or none. A write that fails (read-only or full disk) warns
      and leaves the load's model as it is.
    - Tensors a model keeps are copied out of the mapping, so an entry may be replaced or removed
      while a model loaded from it lives.
    - One entry per (file, load options): a stale one is replaced in place; a write prunes entries
      whose file no longer exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

FORMAT = 1  # bump when what an entry's parts mean changes (gguf.prepare, quant.py's layouts)
ENV_OFF = "FOVEAL_WEIGHT_CACHE"  # "0", "off", "false" or "no": no cache
ENV_ROOT = "FOVEAL_CACHE"  # foveal's cache root (testing/smollm2.py keeps the test GGUF there)
SUFFIX = ".safetensors"
TOKENIZER_SUFFIX = ".tokenizer.json"


class Corrupt(Exception):
    """An entry that cannot be used as it is: unreadable, incomplete, or a tensor failing its check."""


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1").strip().lower() not in ("0", "off", "false", "no")


def folder() -> Path:
    root = os.environ.get(ENV_ROOT) or Path.home() / ".cache" / "foveal"
    return Path(root) / "prepared"


def key(path: Path, header_bytes: int, variant: dict[str, Any]) -> dict[str, Any]:
    """What an entry must have been made from to serve this load (see INVARIANTS)."""
    import tokenizers
    import transformers

    path = path.resolve()
    stat = path.stat()
    with open(path, "rb") as f:
        header_crc = zlib.crc32(f.read(header_bytes))
    return {
        "format": FORMAT,
        "source": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "header_crc32": header_crc,
        "variant": variant,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def entry_path(key: dict[str, Any]) -> Path:
    """One file per (source, variant): a later build for the same file and options (after the file,
    torch or foveal changed) replaces it."""
    named = json.dumps([key["source"], key["variant"]], sort_keys=True)
    digest = hashlib.sha256(named.encode()).hexdigest()[:16]
    return folder() / f"{Path(key['source']).stem}-{digest}{SUFFIX}"


class Entry:
    """An entry opened for one load: `parts(name)` of each weight, `tokenizer()`; raises `Corrupt`."""

    def __init__(self, path: Path, handle: Any, meta: dict[str, Any]) -> None:
        self.path, self._handle, self._meta = path, handle, meta

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """The parts of the weight `name`, checked, in memory of their own."""
        names = self._meta["weights"].get(name)
        if names is None:
            raise Corrupt(f"it has no weight {name!r}")
        return {part: self._tensor(f"{name}/{part}") for part in names}

    def tokenizer(self) -> tuple[Path, dict[str, Any]]:
        """(the file of the tokenizer's `tokenizers` JSON, checked; the settings it was built with)."""
        path = tokenizer_path(self.path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise Corrupt(f"its tokenizer file cannot be read ({error})") from None
        if zlib.crc32(data) != self._meta["tokenizer_crc32"]:
            raise Corrupt(f"its tokenizer file {path.name} fails its CRC32 check")
        return path, self._meta["tokenizer_settings"]

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            view = self._handle.get_tensor(name)
        except Exception as error:  # safetensors' own errors: a missing name, a short file
            raise Corrupt(f"tensor {name!r} cannot be read ({type(error).__name__}: {error})") from None
        if zlib.crc32(_bytes(view)) != self._meta["crc32"].get(name):
            raise Corrupt(f"tensor {name!r} fails its CRC32 check")
        return view.clone()


def tokenizer_path(entry: Path) -> Path:
    return entry.with_name(entry.name.removesuffix(SUFFIX) + TOKENIZER_SUFFIX)


def open_entry(key: dict[str, Any]) -> Entry | None:
    """The entry made for `key`, opened (memory-mapped); None when there is none or it was made for
    another file or build. Raises `Corrupt` when the file cannot be read as an entry."""
    path = entry_path(key)
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        meta = json.loads(handle.metadata()["foveal"])
        stored = meta["key"]
    except Exception as error:
        raise Corrupt(f"{type(error).__name__}: {error}") from None
    if stored != key:
        return None  # stale: this load writes its own entry in its place
    return Entry(path, handle, meta)


def write(
    key: dict[str, Any],
    weights: dict[str, dict[str, torch.Tensor]],
    tokenizer_json: str,
    tokenizer_settings: dict[str, Any],
) -> Path | None:
    """Store a load's prepared weights (`weights`: tensor name -> parts) and tokenizer as the entry of
    `key`, atomically; the entry's path, or None (with a warning) when it could not be written."""
    from safetensors.torch import save_file

    tensors = {f"{name}/{part}": t.contiguous() for name, parts in weights.items() for part, t in parts.items()}
    text = tokenizer_json.encode("utf-8")
    meta = {
        "key": key,
        "weights": {name: list(parts) for name, parts in weights.items()},
        "crc32": {name: zlib.crc32(_bytes(t)) for name, t in tensors.items()},
        "tokenizer_crc32": zlib.crc32(text),
        "tokenizer_settings": tokenizer_settings,
    }
    path = entry_path(key)
    temporary = [path.with_name(f".{p.name}.{os.getpid()}.tmp") for p in (tokenizer_path(path), path)]
    try:
        header = {"foveal": json.dumps(meta)}  # first: settings that are not JSON write nothing
        path.parent.mkdir(parents=True, exist_ok=True)
        _prune(path.parent)
        temporary[0].write_bytes(text)
        os.replace(temporary[0], tokenizer_path(path))
        save_file(tensors, str(temporary[1]), metadata=header)
        os.replace(temporary[1], path)
    except (OSError, TypeError, ValueError) as error:  # TypeError: settings that are not JSON
        for tmp in temporary:
            with contextlib.suppress(OSError):
                tmp.unlink()
        warnings.warn(
            f"foveal could not write its weight cache entry {path} ({error}); loads of this file prepare its "
            f"weights again. Free space there, set {ENV_ROOT} to a writable folder, or {ENV_OFF}=0",
            stacklevel=2,
        )
        return None
    return path


def _prune(where: Path) -> None:
    """Remove entries whose source file is gone (a GGUF file deleted or moved)."""
    from safetensors import safe_open

    for entry in where.glob(f"*{SUFFIX}"):
        try:
            with safe_open(str(entry), framework="pt") as handle:
                source = json.loads(handle.metadata()["foveal"])["key"]["source"]
        except Exception:  # an unreadable entry is replaced when its own file loads again
            continue
        if not Path(source).exists():
            entry.unlink(missing_ok=True)
            tokenizer_path(entry).unlink(missing_ok=True)


def _bytes(t: torch.Tensor) -> memoryview:
    # numpy declares ndarray.__buffer__ for Python >= 3.12 only; the buffer protocol is there on 3.11 too
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
