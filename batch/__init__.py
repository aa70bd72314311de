"""foveal.batch: one skill over many images (a folder, a glob, a list, a table), resumable, locally or on Ray.

    from foveal import batch
    job = batch.run("photos/", "detect", object="car", out="cars.jsonl", resume=True)
    for record in job:            # records in input order, as they complete
        print(record.image, record.result or record.error)
    print(job.summary().line())   # images/s, errors, the engine's mean batch size

The command line is `foveal batch INPUT --skill detect --object car --out cars.jsonl [--resume
[--allow-changed]] [--ray]` (cli.py). Locally the engine is kept full by reading images ahead on
worker threads (readahead.py); results go to an append-only JSONL file that survives any kill
(writer.py), one image a line; `ray_job.py` runs the same job as Ray Data with one model per actor
and writes the same lines.

Resuming is safe (job.py): beside `cars.jsonl` the job record `cars.jsonl.job.json` names the
skill, its argument, output type and settings, the model (path and checkpoint files) and every
input image's fingerprint. `resume=True` on a file of another job, or over an input that changed
since (images added, removed, modified, reordered), raises OutputError (the CLI exits 2) with one
line saying what differs and what to do, and changes no byte of either file. `allow_changed=True`
accepts a changed input: the lines of unchanged images are kept, the rest redone or dropped, and
the file ends as an uninterrupted run over the input as it is now, in input order. An entry of
INPUT that cannot be read (a dangling link, a link loop, no read permission, a sub-folder that
cannot be listed) is an error line in its place, like an image that cannot be decoded.
"""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.batch")

from foveal.batch.inputs import Input, InputError, input_of_images, open_input  # noqa: E402
from foveal.batch.job import job_path  # noqa: E402
from foveal.batch.records import Record  # noqa: E402
from foveal.batch.runner import BatchRun, Summary, run  # noqa: E402
from foveal.batch.skill_call import SKILLS, SkillCall  # noqa: E402
from foveal.batch.writer import OutputError, ResultsWriter  # noqa: E402

__all__ = [
    "SKILLS",
    "BatchRun",
    "Input",
    "InputError",
    "OutputError",
    "Record",
    "ResultsWriter",
    "SkillCall",
    "Summary",
    "input_of_images",
    "job_path",
    "open_input",
    "run",
]
