"""Token tables: every token id's bytes and the special ids of a tokenizer, kept on disk between processes.

PROBLEM: the grammar layer's tokenizer handle (tokenizer.py) needs each token's bytes and which ids are
special, as llguidance reads them from the tokenizer's JSON. Reading them means building an
LLTokenizer from that JSON, which costs more than the rest of the handle together, and a process pays
it at its first structured call (a script's first answer, a server's first request).
SOLUTION: the table, once read, is written to `$FOVEAL_CACHE/tokenizers` (`~/.cache/foveal` by default),
named by the tokenizer JSON's digest, the vocab size, the EOS id and llguidance's version; later
processes read it instead, and a write removes the tables of other llguidance versions.
`FOVEAL_TOKENIZER_CACHE=0` turns it off.
INVARIANTS: a table read is the table llguidance builds for the same JSON, EOS, vocab size and
llguidance version (the name says all four); a file that is unreadable, incomplete or inconsistent is
reported, never used, and written again; a table that cannot be written costs only the time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import warnings
import zipfile
from pathlib import Path

import llguidance
import numpy as np

ENV_ROOT = "FOVEAL_CACHE"  # foveal's cache root, as the weight cache's (engine/models/weight_cache.py)
ENV_OFF = "FOVEAL_TOKENIZER_CACHE"
FORMAT = 1  # bumped when what a table holds changes


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1").strip().lower() not in ("0", "off", "false", "no")


def table_path(digest: str, eos: int, size: int) -> Path:
    root = Path(os.environ.get(ENV_ROOT) or Path.home() / ".cache" / "foveal")
    return root / "tokenizers" / f"{digest}.V{size}.eos{eos}{_suffix()}"


def _suffix() -> str:
    """How the names of this llguidance's and this format's tables end."""
    return f".llguidance-{_llguidance_version()}.f{FORMAT}.npz"


@functools.cache
def _llguidance_version() -> str:
    return importlib.metadata.version("llguidance")


def token_table(tokenizer_json: str, digest: str, eos: int, size: int) -> tuple[list[bytes], list[int]]:
    """(bytes of every token id, the special ids) of the tokenizer whose JSON is `tokenizer_json`
    (`digest`: its hash), as llguidance reads them: from the cache when there, else read and written."""
    path = table_path(digest, eos, size) if enabled() else None
    if path is not None and path.exists():
        table = _read(path, size)
        if table is not None:
            return table
    built = llguidance.LLTokenizer(tokenizer_json, n_vocab=size, eos_token=eos)
    n = built.vocab_size
    table = [built.decode_bytes([i]) for i in range(n)], [i for i in range(n) if built.is_special_token(i)]
    if path is not None:
        _write(path, *table)
    return table


def _read(path: Path, size: int) -> tuple[list[bytes], list[int]] | None:
    try:
        with np.load(path, allow_pickle=False) as arrays:
            lengths, data, special = arrays["lengths"], arrays["data"], arrays["special"]
        ends = np.cumsum(lengths, dtype=np.int64)
        n = len(lengths)
        if (
            n != size
            or (n and ends[-1] != len(data))
            or (lengths < 0).any()
            or ((special < 0) | (special >= n)).any()
        ):
            raise ValueError(
                f"{n} tokens of {int(ends[-1]) if n else 0} bytes in {len(data)}, for a vocab of {size}"
            )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        warnings.warn(
            f"foveal's token table {path} is damaged ({error}); reading the tokenizer again", stacklevel=4
        )
        return None
    blob, starts = data.tobytes(), (ends - lengths).tolist()
    return [blob[a:b] for a, b in zip(starts, ends.tolist(), strict=True)], special.tolist()


def _write(path: Path, tokens: list[bytes], special: list[int]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as out:
            np.savez(
                out,
                lengths=np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)),
                data=np.frombuffer(b"".join(tokens), dtype=np.uint8),
                special=np.asarray(special, dtype=np.int64),
            )
        os.replace(temporary, path)
        for stale in path.parent.glob("*.npz"):  # another llguidance's or format's: never read again
            if not stale.name.endswith(_suffix()):
                stale.unlink(missing_ok=True)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        warnings.warn(
            f"foveal could not write its token table {path} ({error}); each process's first structured call "
            f"reads the tokenizer again. Set {ENV_ROOT} to a writable folder, or {ENV_OFF}=0",
            stacklevel=4,
        )
