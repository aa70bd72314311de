"""A batch job's identity, kept beside its results, and what `--resume` may do with a results file.

PROBLEM
    `--resume` skips the images the results file already holds. That is right only when the file
    was written by the same job: the same skill and argument (object, question, length, prompt),
    output type and settings, the same model, the same images. Resuming a detect file as a caption
    job, or after the folder changed, would silently mix two jobs' answers in one file.
SOLUTION
    Before its first line, a job writes its *job record* to `RESULTS.jsonl.job.json` beside the
    results (`job_path`), replaced atomically (`writer.write_atomically`). A sidecar rather than a
    header line keeps every line of the JSONL one image's record: `pandas.read_json(lines=True)`,
    DuckDB, `jq`, `wc -l` and `cat a.jsonl b.jsonl` keep working unchanged, and the record (one
    fingerprint per image: too large for a header) can be replaced without rewriting the results.
    The record holds (`job_record`):
      job    skill, argument, output type (a JSON schema; a pydantic class by its schema; other
             types by their repr), settings: what changes the answers;
      model  its source (the resolved path, or a hub id; the embedded model is its folder) and the
             name, size and mtime of the checkpoint's files (one retrained in place is another
             model). The device is not part of it: a job may move to another machine;
      input  every key in input order with its source's fingerprint: size, mtime, mode and owner
             of a path (an edited file, a fixed permission, a repaired link all count as modified;
             a stat, not a read: no pass over the images before the run), a digest of bytes and
             in-memory images (a table of image bytes is read once more for it, before the run).
    `plan_output` compares the record with the job about to run and reads only: any difference
    raises OutputError (exit 2) saying what differs and what to do, and changes no byte of either
    file. Results without a record (an older foveal) are not resumed: nothing tells their job.
    A changed input (images added, removed, modified, reordered) is refused the same way unless
    `allow_changed`: then the lines of images still in the input with their fingerprint are kept,
    the others dropped, and the file stays in input order: it is replaced by the kept lines up to
    the first image that needs work, the kept lines after that are written again when their turn
    comes (`merge_kept`), between the new ones, and the record is replaced by the new input's.
    `open_results` carries a plan out once the model has passed its checks.
INVARIANTS (tests/batch/test_job.py)
    1. A refused resume leaves the results file and its record byte-identical.
    2. Once `open_results` returns, the record describes the input being run and the results file
       holds a prefix of it, in input order; with allow_changed the run ends with the file of an
       uninterrupted run over the input as it is now.
    3. Kills: the record is written before the first line; with allow_changed the results are
       replaced before the record, and every line kept in the replaced file is valid under both
       records, so a kill at any moment leaves files a later resume accepts (with allow_changed
       when the old record is still in place). Kept lines not yet written again when a kill lands
       are redone by that resume.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from foveal.batch.inputs import Input, Unreadable
from foveal.batch.skill_call import ARGUMENT, SkillCall
from foveal.batch.writer import OutputError, ResultsWriter, read_lines, write_atomically

FORMAT = 1  # the job record's layout: a record of another layout is not compared, it is refused
T = TypeVar("T")


def job_path(out: str | Path) -> Path:
    """The job record of the results file `out`: `out` + ".job.json", in the same folder."""
    out = Path(out)
    return out.with_name(out.name + ".job.json")


# ---- the job record -----------------------------------------------------------------------------------------


def job_record(call: SkillCall, model: Any, source: Input) -> dict:
    """The identity of running `call` with `model` (None, a path, or a loaded Model) over `source`."""
    record = {
        "foveal_batch_job": FORMAT,
        "job": {
            "skill": call.skill,
            "argument": call.argument,
            "output_type": _output_type(call.output_type),
            "settings": dict(call.settings),
        },
        "model": model_identity(model),
        "input": {"items": [[key, fingerprint(item)] for key, item in source.items()]},
    }
    return json.loads(json.dumps(record, ensure_ascii=False, sort_keys=True, default=repr))  # as read back


def model_identity(model: Any) -> dict:
    """The model as the runner knows it: its source and its checkpoint files' names, sizes and mtimes."""
    source = _model_source(model)
    path = Path(source)
    if not path.exists():
        return {"source": source, "files": None}  # a hub id (or an object that names no folder)
    path = path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {"source": str(path), "files": [[p.name, *_size_and_mtime(p)] for p in files]}


def fingerprint(source: Any) -> str:
    """What tells that an input item changed: a path's stat (or why it has none), else a digest."""
    if isinstance(source, str | os.PathLike):
        try:
            stat = os.stat(source)
        except OSError as error:
            return f"unreadable:{errno.errorcode.get(error.errno or 0, error.errno)}"
        return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_mode:o}:{stat.st_uid}:{stat.st_gid}"
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(source, Unreadable):  # a cell that holds no image (invalid base64): its reason tells it
        digest.update(source.reason.encode())
        return f"unreadable:{digest.hexdigest()}"
    if isinstance(source, bytes | bytearray | memoryview):
        digest.update(source)
        return f"bytes:{digest.hexdigest()}"
    to_bytes = getattr(source, "tobytes", None)  # PIL images, numpy arrays
    if not callable(to_bytes):
        return f"object:{type(source).__qualname__}"  # nothing to compare: only its type
    shape = getattr(source, "shape", None) or (getattr(source, "mode", ""), getattr(source, "size", ""))
    digest.update(f"{type(source).__qualname__}:{shape}:{getattr(source, 'dtype', '')}:".encode())
    digest.update(to_bytes())
    return f"pixels:{digest.hexdigest()}"


def _model_source(model: Any) -> str:
    if model is None:
        import foveal

        return str(Path(foveal.__file__).parent / "embedded")  # foveal.model.EMBEDDED, without torch
    if isinstance(model, str | os.PathLike):
        return os.fspath(model)
    source = getattr(getattr(model, "family", None), "source", None)
    return str(source) if source is not None else f"a {type(model).__qualname__} object"


def _output_type(output_type: Any) -> Any:
    if output_type is None or isinstance(output_type, dict):
        return output_type
    schema = getattr(output_type, "model_json_schema", None)  # a pydantic model class
    if callable(schema):
        return {"pydantic": f"{output_type.__module__}.{output_type.__qualname__}", "schema": schema()}
    return repr(output_type)


def _size_and_mtime(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


# ---- the plan -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kept:
    """A line of the resumed file (allow_changed) that goes back in at its image's new place."""

    key: str
    line: str


@dataclass(slots=True)
class OutputPlan:
    """What a run does with its results file: the lines it keeps, and what it writes before work."""

    path: Path
    record: dict  # the job record of this run
    resume: bool
    done: frozenset[str] = frozenset()  # keys of the lines the file holds (or keeps): a prefix of the input
    kept: dict[str, str] = field(default_factory=dict)  # key -> line, written again in its place
    rewrite: list[str] | None = None  # lines the file is replaced by before work (None: as it is)
    write_record: bool = True

    @property
    def skipped(self) -> int:
        return len(self.done) + len(self.kept)

    def needs_work(self, key: str) -> bool:
        return key not in self.done and key not in self.kept


def plan_output(path: Path, record: dict, *, resume: bool, allow_changed: bool = False) -> OutputPlan:
    """How this run uses `path`; OutputError, before any byte is written, when it may not resume it."""
    lines, _ = read_lines(path) if resume and path.exists() else ([], 0)
    if not lines:  # nothing to protect: the job starts (or starts again) from the first image
        return OutputPlan(path, record, resume)
    previous = _read_record(path)
    differences = _job_differences(previous, record)
    if differences:
        raise OutputError(
            f"--out {path} holds the results of another job ({'; '.join(differences)}): rerun with that "
            f"job's options, or choose another --out (or delete {path.name} and {job_path(path).name} "
            "to start over)"
        )
    keys = [key for key, _ in record["input"]["items"]]
    if previous["input"] == record["input"] and [key for key, _ in lines] == keys[: len(lines)]:
        return OutputPlan(path, record, resume, frozenset(keys[: len(lines)]), write_record=False)
    if not allow_changed:
        raise OutputError(
            f"--out {path}: INPUT changed since the first run ({_input_changes(previous, record, lines)}); "
            "pass --allow-changed to keep the lines of unchanged images and redo the rest, or choose "
            "another --out"
        )
    return _plan_changed(path, previous, record, lines)


def _plan_changed(path: Path, previous: dict, record: dict, lines: list[tuple[str, str]]) -> OutputPlan:
    """allow_changed: keep the lines whose image is in the input with its first run's fingerprint."""
    before, now = dict(previous["input"]["items"]), dict(record["input"]["items"])
    valid = {key: line for key, line in lines if key in now and before.get(key) == now[key]}
    keys = [key for key, _ in record["input"]["items"]]
    prefix = list(itertools.takewhile(valid.__contains__, keys))
    kept = {key: valid[key] for key in keys[len(prefix) :] if key in valid}
    same_file = [key for key, _ in lines] == prefix
    return OutputPlan(
        path,
        record,
        True,
        frozenset(prefix),
        kept,
        rewrite=None if same_file else [valid[key] for key in prefix],
        write_record=previous != record,
    )


def open_results(plan: OutputPlan) -> ResultsWriter:
    """Carry `plan` out and open the results for appending (the first run's record before any line; with
    allow_changed, the results replaced before the record: see INVARIANTS 3)."""
    if plan.rewrite is not None:
        write_atomically(plan.path, "".join(line + "\n" for line in plan.rewrite).encode("utf-8"))
    if plan.write_record:
        text = json.dumps(plan.record, ensure_ascii=False, sort_keys=True)
        write_atomically(job_path(plan.path), (text + "\n").encode("utf-8"))
    return ResultsWriter(plan.path, resume=plan.resume)


def merge_kept(keys: Iterable[str], plan: OutputPlan, computed: Iterator[T]) -> Iterator[T | Kept]:
    """`computed` (one item per image that needed work, in input order) with the plan's kept lines put
    back at their images' places; `computed` unchanged (in any order) when nothing is kept."""
    if not plan.kept:
        yield from computed
        return
    for key in keys:
        if key in plan.done:
            continue
        line = plan.kept.get(key)
        yield Kept(key, line) if line is not None else next(computed)


# ---- reading and comparing ----------------------------------------------------------------------------------


def _read_record(path: Path) -> dict:
    record_file = job_path(path)
    start_over = f"choose another --out, or delete {path.name} to start over"
    if not record_file.exists():
        raise OutputError(
            f"--out {path} has results but no job record ({record_file.name}), so --resume cannot tell "
            f"which job wrote them; {start_over}"
        )
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
        if record["foveal_batch_job"] != FORMAT:
            raise ValueError(f"layout {record['foveal_batch_job']!r}, this foveal writes {FORMAT}")
        if not {"job", "model", "input"} <= record.keys() or "items" not in record["input"]:
            raise ValueError("a part of it is missing")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise OutputError(
            f"--out {path}: its job record {record_file.name} cannot be read ({error}); {start_over}"
        ) from None
    return record


def _job_differences(previous: dict, record: dict) -> list[str]:
    """What differs between two records other than the input, in the command line's terms."""
    old, new = previous["job"], record["job"]
    differences = []
    if old["skill"] != new["skill"]:
        differences.append(f"{_call_text(old)} -> {_call_text(new)}")
    elif old["argument"] != new["argument"]:
        differences.append(f"--{ARGUMENT[new['skill']]} {old['argument']!r} -> {new['argument']!r}")
    if old["output_type"] != new["output_type"]:
        differences.append("--schema (the output type) differs")
    if old["settings"] != new["settings"]:
        differences.append(f"--settings {_json(old['settings'])} -> {_json(new['settings'])}")
    old_model, new_model = previous["model"], record["model"]
    if old_model["source"] != new_model["source"]:
        differences.append(f"--model {old_model['source']} -> {new_model['source']}")
    elif old_model["files"] != new_model["files"]:
        changed = _changed_files(old_model["files"] or [], new_model["files"] or [])
        differences.append(
            f"--model {new_model['source']}: its files changed since the first run ({changed})"
        )
    return differences


def _input_changes(previous: dict, record: dict, lines: list[tuple[str, str]]) -> str:
    old_items, new_items = previous["input"]["items"], record["input"]["items"]
    before, now = dict(old_items), dict(new_items)
    kinds = {
        "added": [key for key in now if key not in before],
        "removed": [key for key in before if key not in now],
        "modified": [key for key in now if key in before and before[key] != now[key]],
    }
    parts = [f"{len(keys)} {kind} (e.g. {keys[0]!r})" for kind, keys in kinds.items() if keys]
    if [key for key, _ in old_items if key in now] != [key for key, _ in new_items if key in before]:
        parts.append("the order changed")
    if not parts:  # the same input, but lines that are not its first images in order
        parts.append(f"its {len(lines)} lines do not follow the input's order")
    return ", ".join(parts)


def _call_text(job: dict) -> str:
    flag = ARGUMENT.get(job["skill"], "argument")
    return f"--skill {job['skill']} --{flag} {job['argument']!r}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _changed_files(old: list, new: list) -> str:
    before, now = {f[0]: f for f in old}, {f[0]: f for f in new}
    names = sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
