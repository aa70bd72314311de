"""The results file: JSONL written append-only, one flushed line per image, resumable after any kill.

PROBLEM
    A batch over 100,000 images runs for hours. It may be killed at any moment (SIGKILL, a lost
    node, Ctrl-C) and must then resume without redoing finished images and without ever leaving
    an image with two lines or none. A kill can land in the middle of writing a line.
SOLUTION
    Each record is one JSON line ending in "\\n", handed to the kernel by a single `os.write` on a
    file opened O_APPEND (nothing buffered in the process: a SIGKILL loses no finished line), with
    an fsync every `FSYNC_EVERY_S` and at close against power loss. A line without its "\\n" was
    cut by a kill: on resume that torn tail, and only it, is cut off (`os.truncate` to the end of
    the last whole line), then the keys of the whole lines are the images already done. Lines
    are written in input order (the pipeline emits in order), so the done set is always a prefix
    of the input, and a resumed file stays in input order. Whether the file may be resumed at all
    (the same job, the same input) is job.py's to decide, before a `ResultsWriter` opens it;
    `read_lines` reads it for that without changing a byte, and `write_atomically` is how job.py
    replaces a file (the job record; the results, when --allow-changed drops lines).
INVARIANTS (tests/batch/test_writer.py, test_resume.py, test_job.py)
    1. A whole line is never rewritten or removed by the writer; only a torn tail (no "\\n") is
       cut, on resume. (--allow-changed drops the lines of changed images: one atomic replace.)
    2. After a kill at any moment and a resume, the file has exactly one line per input image.
    3. Without resume, an existing non-empty file is refused before any work (never overwritten).
    4. A results file that holds an image twice is refused on resume, naming the file and both lines.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

FSYNC_EVERY_S = 1.0


class OutputError(ValueError):
    """The results file cannot be used as asked (exists without --resume, corrupt, not writable)."""


class ResultsWriter:
    """Append-only JSONL results; `done` holds the keys already written (with resume=True)."""

    def __init__(self, path: str | Path, *, resume: bool) -> None:
        self.path = Path(path)
        check_output(self.path, resume)
        self.done: set[str] = set()
        if resume and self.path.exists():
            lines, whole = read_lines(self.path)
            if whole < self.path.stat().st_size:
                os.truncate(
                    self.path, whole
                )  # a kill cut this line mid-write: it never held a finished record
            self.done = {key for key, _ in lines}
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._synced = time.monotonic()
        self.written = 0

    def write(self, key: str, line: str) -> None:
        """Append one record (`line`: its JSON text, without newline) and hand it to the kernel."""
        data = (line + "\n").encode("utf-8")
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop anyway, as os.write may be partial
            view = view[os.write(self._fd, view) :]
        self.done.add(key)
        self.written += 1
        if time.monotonic() - self._synced > FSYNC_EVERY_S:
            os.fsync(self._fd)
            self._synced = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_output(path: Path, resume: bool) -> None:
    """Refuse, before any work, an output that cannot be written or would be overwritten."""
    if path.is_dir():
        raise OutputError(
            f"--out {path} is a folder; name a .jsonl file in it, e.g. {path / 'results.jsonl'}"
        )
    if not path.parent.is_dir():
        raise OutputError(f"--out {path}: the folder {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"--out {path} cannot be written (permission denied); choose another path")
    if path.exists() and path.stat().st_size > 0 and not resume:
        raise OutputError(
            f"--out {path} already has results; pass --resume to skip the images it holds, "
            "or choose another file"
        )


def read_done(path: Path) -> set[str]:
    """Keys of the whole lines in `path` (missing: none); the file is not changed."""
    return {key for key, _ in read_lines(path)[0]} if path.exists() else set()


def read_lines(path: Path) -> tuple[list[tuple[str, str]], int]:
    """The whole lines of `path` as (key, line text without newline), and the byte length they span
    (less than the file's size when a kill left a torn tail). Reads only; OutputError on a line
    that is not a results line, or that repeats an image an earlier line holds (the writer never
    writes one twice: a file edited or concatenated by hand)."""
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1  # bytes up to the end of the last whole line
    lines = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(data[:whole].splitlines(), 1):
        try:
            text = line.decode("utf-8")
            key = json.loads(text)["image"]
            if not isinstance(key, str):  # every key is text (inputs.py); a list or dict is no image's
                raise TypeError(key)
        except (ValueError, KeyError, TypeError):
            raise OutputError(
                f"--out {path} line {number} is not a results line ({line[:60]!r}); this file was not "
                "written by foveal batch: choose another --out"
            ) from None
        if key in first_line:
            raise OutputError(
                f"--out {path} line {number} repeats the result for image {key!r} of line {first_line[key]}: "
                "a results file holds one line per image; delete one of the two lines (or the file, to "
                "start over), then run again with --resume"
            )
        first_line[key] = number
        lines.append((key, text))
    return lines, whole


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by `data` all at once: a reader (or a kill) sees the old file or the new, never a
    part (a temporary file in the same folder, fsynced, renamed over `path`, the folder fsynced)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the results from the user's other tools
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power loss
    finally:
        os.close(folder)
