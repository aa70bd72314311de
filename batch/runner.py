"""`foveal.batch.run`: one skill over many images in this process, as records, optionally into a results file.

The order of work: resolve INPUT (folder, glob, list, table: `inputs.py`), check the skill's
arguments and settings, check `out` (exists without resume?) and, with resume, that `out` belongs
to this job and this input (`job.plan_output`: another job, or a changed input without
allow_changed, is refused without touching the file), load the model, check what needs it (the
arguments as the model takes them, an output type the grammar cannot enforce); every refusal up to
here raises before any image is read and before any file is written. Then the job record is
written (or, with allow_changed, the file trimmed to the lines still valid: `job.open_results`),
the images not yet done go through the read-ahead pipeline (`readahead.py`) and each outcome
becomes a `Record`, appended to `out` in input order (the kept lines of a changed input written
again in their places) and yielded to the caller. A `BatchRun` is iterable once; `summary()`
tells images/s and the engine's mean batch size (decode rows per step, measured over this run).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foveal.batch.inputs import Input, check_readable, input_of_images, open_input
from foveal.batch.job import Kept, OutputPlan, job_record, merge_kept, open_results, plan_output
from foveal.batch.readahead import pipeline
from foveal.batch.records import Record, record_of
from foveal.batch.skill_call import SkillCall
from foveal.batch.writer import ResultsWriter, check_output

READ_WORKERS = 2  # decode threads: a few keep ahead of the engine on 2 cores without starving it


@dataclass(slots=True)
class Summary:
    images: int  # in the input
    skipped: int  # already in the results file (resume; with allow_changed, the lines kept)
    done: int  # records made by this run
    errors: int  # of which error lines
    seconds: float
    mean_batch: float | None  # engine decode rows per step over the run (None: no engine stats)
    mean_prefill: float | None  # engine prefill rows per step: they share the step's max_batch rows
    max_batch: int | None

    @property
    def images_per_s(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        batch = (
            ""
            if self.mean_batch is None
            else f", engine mean batch {self.mean_batch:.1f} decode + {self.mean_prefill:.1f} prefill rows "
            f"of {self.max_batch}"
        )
        skipped = f" ({self.skipped} already done)" if self.skipped else ""
        return (
            f"{_count(self.done, 'image')} in {self.seconds:.1f} s ({self.images_per_s:.1f} images/s), "
            f"{_count(self.errors, 'error')}{skipped}{batch}"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class BatchRun:
    """A checked batch job, ready to run: iterate it (once) for its records, then read `summary()`."""

    def __init__(
        self,
        source: Input,
        call: SkillCall,
        model: Any,
        owns_model: bool,
        writer: ResultsWriter | None,
        plan: OutputPlan | None,
        *,
        progress: bool | None,
        ordered: bool,
        window: int | None,
        read_workers: int,
    ) -> None:
        self.input, self.call, self.model, self.writer = source, call, model, writer
        self._owns_model = owns_model
        self._progress, self._ordered = progress, ordered
        self._window = window or 2 * model.config.max_batch
        self._read_workers = read_workers
        self._plan = plan or OutputPlan(Path(), {}, False)  # no results file: nothing done, nothing kept
        self.skipped = self._plan.skipped
        self._summary: Summary | None = None
        self._iterated = False

    def __iter__(self) -> Iterator[Record]:
        if self._iterated:
            raise RuntimeError("a BatchRun runs once; call foveal.batch.run(...) again for another pass")
        self._iterated = True
        return self._records()

    def run(self) -> Summary:
        """Run to the end without keeping the records (they are in the results file)."""
        for _ in self:
            pass
        return self.summary()

    def summary(self) -> Summary:
        if self._summary is None:
            raise RuntimeError("the run has not finished; iterate it first (or call .run())")
        return self._summary

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._owns_model:
            self.model.close()

    def _records(self) -> Iterator[Record]:
        from tqdm import tqdm

        from foveal.errors import ModelClosedError

        plan = self._plan
        items = (
            (key, image) for key, image in self.input.items() if plan.needs_work(key)
        )  # lazy: tables stream
        before = engine_counts(self.model)
        bar = tqdm(
            total=len(self.input),
            initial=self.skipped,
            desc=self.call.skill,
            unit="image",
            disable=None if self._progress is None else not self._progress,
            smoothing=0.1,
        )
        done = errors = 0
        started = time.perf_counter()
        try:
            outcomes = pipeline(
                items,
                lambda source: self.model.encode_image(check_readable(source)),
                lambda image: self.call.call(self.model, image),
                window=self._window,
                read_workers=self._read_workers,
                ordered=self._ordered,
                fatal=(ModelClosedError, KeyboardInterrupt),
            )
            for outcome in merge_kept(self.input.keys, plan, outcomes):
                if isinstance(outcome, Kept):  # a line of the resumed file, back in its place
                    assert self.writer is not None  # a resumed file comes with its writer
                    self.writer.write(outcome.key, outcome.line)
                    continue
                record = record_of(outcome.key, outcome.value)
                if self.writer is not None:
                    self.writer.write(record.image, record.to_json())
                done += 1
                errors += not record.ok
                bar.update()
                yield record
        finally:
            bar.close()
            seconds = time.perf_counter() - started
            decode, prefill, steps = counts_delta(before, engine_counts(self.model))
            self._summary = Summary(
                len(self.input),
                self.skipped,
                done,
                errors,
                seconds,
                decode / steps if steps else None,
                prefill / steps if steps else None,
                getattr(getattr(self.model, "config", None), "max_batch", None),
            )
            self.close()


def run(
    inputs: Any,
    skill: str,
    *,
    object: str | None = None,
    question: str | None = None,
    length: str | None = None,
    prompt: str | None = None,
    output_type: Any = None,
    settings: Mapping[str, Any] | None = None,
    model: Any = None,
    device: str = "auto",
    out: str | Path | None = None,
    resume: bool = False,
    allow_changed: bool = False,
    ordered: bool = True,
    progress: bool | None = None,
    window: int | None = None,
    read_workers: int = READ_WORKERS,
    column: str | None = None,
    key_column: str | None = None,
) -> BatchRun:
    """Check a batch job and return it, ready to iterate: `for record in foveal.batch.run(...)`.

    inputs: INPUT as the command line takes it (a folder, a glob, a list file, .jsonl/.parquet),
    or images in Python (a list of paths / PIL images / bytes / arrays, or a {key: image} dict).
    skill and its argument: detect/point `object`, query `question`, caption `length`, generate
    `prompt` (+ `output_type`). model: a loaded `foveal.Model` (kept open), or a checkpoint path /
    None for the embedded model (loaded here on `device`, closed when the run ends). out: a JSONL results file
    written as the records come, its job record beside it (`out` + ".job.json"). resume=True skips
    the images it holds, once it is checked to be this job's over this input (OutputError if not);
    allow_changed=True (with resume) accepts an input changed since: the lines of unchanged images
    are kept, the rest redone, the file in input order (foveal.batch.job). ordered=False yields
    records as they complete (only without `out`, which is kept in input order).
    Every bad input raises here, before any image is read (ValueError subclasses, SchemaError).
    """
    if out is not None and not ordered:
        raise ValueError("ordered=False cannot write `out` (a results file is kept in input order); drop one")
    check_flags(resume, allow_changed)
    source = _open(inputs, column, key_column)
    call = SkillCall.of(
        skill,
        object=object,
        question=question,
        length=length,
        prompt=prompt,
        output_type=output_type,
        settings=settings,
    )
    plan = None
    if out is not None:
        check_output(Path(out), resume)
        record = job_record(call, model, source)
        plan = plan_output(Path(out), record, resume=resume, allow_changed=allow_changed)
    loaded, owns = _model(model, device)
    try:
        call.check(loaded)
        writer = open_results(plan) if plan is not None else None
    except BaseException:
        if owns:
            loaded.close()
        raise
    return BatchRun(
        source,
        call,
        loaded,
        owns,
        writer,
        plan,
        progress=progress,
        ordered=ordered,
        window=window,
        read_workers=read_workers,
    )


def check_flags(resume: bool, allow_changed: bool) -> None:
    if allow_changed and not resume:
        raise ValueError("--allow-changed (allow_changed) applies to a resumed run; add --resume, or drop it")


def _open(inputs: Any, column: str | None, key_column: str | None) -> Input:
    if isinstance(inputs, Input):
        return inputs
    if isinstance(inputs, str | Path):
        return open_input(inputs, column=column, key_column=key_column)
    return input_of_images(inputs)


def _model(model: Any, device: str) -> tuple[Any, bool]:
    if model is not None and not isinstance(model, str | Path):
        return model, False
    import foveal

    return foveal.load(model, device=device), True


def engine_counts(model: Any) -> tuple[int, int, int] | None:
    """The engine's running totals (decode rows, prefill rows, steps); a delta over a run is its share
    (other callers of a shared model count too: the mean is the engine's, not only this run's)."""
    engine = getattr(model, "engine", None)
    if engine is None:
        return None
    stats = engine.stats()
    return stats["decode_rows"], stats["prefill_rows"], stats["steps"]


def counts_delta(before: tuple | None, after: tuple | None) -> tuple[int, int, int]:
    if before is None or after is None:
        return 0, 0, 0
    return tuple(a - b for a, b in zip(after, before, strict=True))
