"""A batch job on Ray: Ray Data over the images, one `Model` per actor, the same JSONL as a local run.

The driver resolves INPUT, checks the job and --out exactly as a local run does (`runner.run`):
with --resume, --out must belong to this job and this input (`job.plan_output`; --allow-changed
accepts a changed input, and the kept lines go back in their places as the rows arrive), and the
images --out already holds are skipped. The rest become a Ray dataset of (key, source) rows, where a
source is a path (which every node must be able to read: a shared filesystem) or the image's
bytes (tables with a bytes column: the bytes travel in the dataset). `map_batches` sends batches to
a pool of `concurrency` actors (`SkillActor`), each holding one model (one GPU each when the cluster
has GPUs) and running its batch through the same read-ahead pipeline as a local run, so its engine
stays full; each row comes back as its finished output line (`records.Record.to_json`, the local
run's encoding). The dataset preserves input order, and the driver appends the lines to --out
through the same resumable writer: a killed Ray run resumes like a local one, and a Ray run's
file equals a local run's line for line.

`ray.init()` joins the cluster named by RAY_ADDRESS (or an already initialized Ray), else starts a
local instance. Checks that need the model (settings against the model, a schema its grammar
cannot enforce) run on the driver only for what needs no model; the rest run in each actor before
its first image, and fail the job with the SDK's message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from foveal.batch.inputs import Unreadable, check_readable
from foveal.batch.job import Kept, job_record, merge_kept, open_results, plan_output
from foveal.batch.readahead import pipeline
from foveal.batch.records import record_of
from foveal.batch.runner import READ_WORKERS, Summary, _open, check_flags
from foveal.batch.skill_call import SkillCall
from foveal.batch.writer import check_output

DEFAULT_WINDOW = 64  # per actor: 2 x the SDK's default max_batch_size (32)


class SkillActor:
    """One model per Ray actor; `__call__` turns a batch of (image, source) rows into output lines
    (and whether each is a result: the driver counts errors without parsing the lines again)."""

    def __init__(self, model: str | None, device: str, call: SkillCall, window: int) -> None:
        import foveal

        self.model = foveal.load(model, device=device)
        call.check(self.model)  # the SDK's refusals, before this actor's first image
        self.call, self.window = call, window

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        import numpy as np

        from foveal.errors import ModelClosedError

        keys = [str(key) for key in batch["image"]]
        sources = [
            Unreadable(str(why))
            if why
            else bytes(s)
            if isinstance(s, bytes | bytearray | np.bytes_)
            else str(s)
            for s, why in zip(batch["source"], batch["unreadable"], strict=True)
        ]
        outcomes = pipeline(
            zip(keys, sources, strict=True),
            lambda source: self.model.encode_image(check_readable(source)),
            lambda image: self.call.call(self.model, image),
            window=self.window,
            read_workers=READ_WORKERS,
            fatal=(ModelClosedError,),
        )
        records = [record_of(o.key, o.value) for o in outcomes]
        return {
            "image": np.array(keys, dtype=object),
            "line": np.array([r.to_json() for r in records], dtype=object),
            "ok": np.array([r.ok for r in records], dtype=bool),
        }


def run_on_ray(
    inputs: Any,
    skill: str,
    *,
    out: str | Path,
    object: str | None = None,
    question: str | None = None,
    length: str | None = None,
    prompt: str | None = None,
    output_type: Any = None,
    settings: Mapping[str, Any] | None = None,
    model: str | Path | None = None,
    device: str = "auto",
    resume: bool = False,
    allow_changed: bool = False,
    concurrency: int | None = None,
    window: int | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    column: str | None = None,
    key_column: str | None = None,
) -> Summary:
    """Run a batch job on Ray and append its lines to `out`; the summary (no engine stats: they are in
    the actors). Arguments as `foveal.batch.run`, plus `concurrency` (actors; default one per GPU,
    else 1) and `batch_size` (rows per actor call; default `window`). `model` is a checkpoint path
    or None (the embedded model), loaded by every actor."""
    if model is not None and not isinstance(model, str | Path):
        raise ValueError("on Ray, model must be a checkpoint path (or None): every actor loads its own copy")
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
    check_output(Path(out), resume)
    plan = plan_output(Path(out), job_record(call, model, source), resume=resume, allow_changed=allow_changed)
    todo = [{"image": key, **_shippable(src)} for key, src in source.items() if plan.needs_work(key)]
    ray = _ray()
    window = window or DEFAULT_WINDOW
    with open_results(plan) as writer:
        started = time.perf_counter()
        done = errors = 0
        rows = (
            _dataset(ray, todo, model, device, call, window, concurrency, batch_size, progress)
            if todo
            else iter(())
        )
        for row in merge_kept(source.keys, plan, rows):
            if isinstance(row, Kept):  # a line of the resumed file, back in its place
                writer.write(row.key, row.line)
                continue
            writer.write(row["image"], row["line"])
            done += 1
            errors += not row["ok"]
        seconds = time.perf_counter() - started
    return Summary(len(source), plan.skipped, done, errors, seconds, None, None, None)


def _dataset(ray, todo, model, device, call, window, concurrency, batch_size, progress):
    """Rows of (image, line, ok) in input order, from a pool of SkillActors."""
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the file is in input order, as a local run's
    if progress is False:
        context.enable_progress_bars = False
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 and device != "cpu" else 0
    actors = concurrency or (int(ray.cluster_resources().get("GPU", 0)) if gpus else 1)
    dataset = ray.data.from_items(todo).map_batches(
        SkillActor,
        fn_constructor_args=(None if model is None else str(model), device, call, window),
        batch_size=batch_size or window,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=gpus,
    )
    try:
        yield from dataset.iter_rows()
    except Exception as error:
        cause = _root_cause(error)
        if isinstance(cause, ValueError | TypeError):  # an actor's check refused the job
            raise ValueError(str(cause).splitlines()[0]) from error
        raise


def _ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError("running on Ray needs Ray Data: pip install -e '.[ray]' in foveal's clone") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
    return ray


def _shippable(source: Any) -> dict[str, str | bytes]:
    """A row's source as Ray Data columns: the path or bytes, and why it is unreadable ("" if it is not;
    an `Unreadable` is no Arrow value, so its reason travels in a column of its own)."""
    if isinstance(source, Unreadable):
        return {"source": b"", "unreadable": source.reason}
    if isinstance(source, str | bytes):
        return {"source": source, "unreadable": ""}
    if isinstance(source, os.PathLike):
        return {"source": os.fspath(source), "unreadable": ""}
    raise ValueError(
        f"on Ray, images must be paths or encoded bytes (got {type(source).__name__}); "
        "save them to files, or run locally with foveal.batch.run"
    )


def _root_cause(error: BaseException) -> BaseException:
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        nested = getattr(error, "cause", None) or error.__cause__
        if nested is None:
            break
        error = nested
    return error
