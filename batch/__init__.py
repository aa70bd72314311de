"""foveal.batch: one skill over many images (a folder, a glob, a list, a table), resumable, locally or on Ray.

    from foveal import batch
    job = batch.run("photos/", "detect", object="car", out="cars.jsonl", resume=True)
    for record in job:            # records in input order, as they complete
        print(record.image, record.result or record.error)
    print(job.summary().line())   # images/s, errors, the engine's mean batch size

The command line is `foveal batch INPUT --skill detect --object car --out cars.jsonl [--resume] [--ray]`
(cli.py). Locally the engine is kept full by reading images ahead on worker threads (readahead.py);
results go to an append-only JSONL file that survives any kill (writer.py); `ray_job.py` runs the
same job as Ray Data with one model per actor and writes the same lines.
"""

from foveal._guard import require_foveal_name

require_foveal_name(__name__, "foveal.batch")

from foveal.batch.inputs import Input, InputError, input_of_images, open_input  # noqa: E402
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
    "open_input",
    "run",
]
