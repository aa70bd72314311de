"""`foveal batch`: the command line of a batch job (registered by foveal.cli; torch loads only when it runs).

    foveal batch INPUT --skill detect|point|caption|query|generate
        [--object X | --question Q | --length L | --prompt P [--schema FILE.json]] [--settings JSON]
        --out RESULTS.jsonl [--resume [--allow-changed]] [--model PATH] [--device auto]
        [--ray [--concurrency N]]

Bad input (a missing INPUT, an empty folder, an unknown skill, a missing argument, bad settings,
a schema the grammar cannot enforce, an --out that holds results without --resume, an --out that
--resume finds written by another job or over an input changed since, without --allow-changed)
exits 2 with one line on stderr, before any image is read and without touching --out. Images that
fail, and entries of INPUT that cannot be read, become error lines; the run exits 0 and its
summary (stderr) counts them. A progress bar with images/s and ETA goes to stderr. `RESUME_HELP`
(the end of `foveal batch --help`) is what a user reads about --resume; foveal.batch.job is how.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from foveal.batch.skill_call import SKILLS
from foveal.cli_common import check_device, fail, quiet_loading

RESUME_HELP = """\
resuming:
  --out gets a job record beside it, RESULTS.jsonl.job.json: the skill and its
  argument, --schema, --settings, the model (its path, its files' sizes and
  times) and every INPUT image (its size, time and mode). The JSONL itself stays
  one image a line. --resume first checks the record: another job's file exits
  2 and changes nothing (rerun with that job's options, or use another --out).
  An INPUT changed since the first run (images added, removed, modified or
  reordered) exits 2 the same way, unless --allow-changed: then the lines of
  unchanged images are kept, the lines of removed or modified images dropped,
  added and modified images done, and the file ends as an uninterrupted run
  over INPUT as it is now would write it, in input order. A run killed at any
  moment (even kill -9) resumes to exactly that file.

unreadable entries:
  a dangling symbolic link, a link loop, a file without read permission or a
  sub-folder that cannot be listed gets an error line in its place (as an
  image that cannot be decoded does), never skipped. Once fixed, its
  fingerprint has changed: --resume --allow-changed redoes its line.
"""


def add_command(commands: Any) -> argparse.ArgumentParser:
    """Register `batch` on foveal's sub-command parsers."""
    what = "run one skill over many images into a JSONL results file (resumable; locally or on Ray)"
    sub = commands.add_parser(
        "batch",
        help=what,
        description=what,
        epilog=RESUME_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.add_argument("input", metavar="INPUT", help="folder, glob, text file of paths, .jsonl or .parquet")
    sub.add_argument("--skill", required=True, choices=SKILLS)
    sub.add_argument("--object", help="detect/point: object phrase, e.g. 'red circle'")
    sub.add_argument("--question", help="query: the question")
    sub.add_argument("--length", choices=("short", "normal", "long"), help="caption length (default normal)")
    sub.add_argument("--prompt", help="generate: the prompt")
    sub.add_argument("--schema", metavar="FILE.json", help="generate: a JSON schema the output follows")
    sub.add_argument("--settings", metavar="JSON", help='e.g. \'{"max_tokens": 64, "temperature": 0}\'')
    sub.add_argument("--out", required=True, metavar="RESULTS.jsonl", help="results, one JSON line per image")
    sub.add_argument(
        "--resume",
        action="store_true",
        help="skip the images --out already holds, after checking it is this job's (see resuming)",
    )
    sub.add_argument(
        "--allow-changed",
        action="store_true",
        help="with --resume: accept an INPUT changed since the first run; keep the lines of "
        "unchanged images, redo the rest (see resuming)",
    )
    sub.add_argument("--model", metavar="PATH", default=None, help="checkpoint (default: the embedded model)")
    sub.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    sub.add_argument("--column", help="table INPUT: the image column (path, bytes or image struct)")
    sub.add_argument("--key-column", help="table INPUT: a column of unique keys for the output lines")
    sub.add_argument("--window", type=int, default=None, help="images in flight (default: 2 x max batch)")
    sub.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_argument(
        "--ray",
        action="store_true",
        help="run on Ray (also when RAY_ADDRESS is set): ray.init() joins that cluster",
    )
    sub.add_argument(
        "--concurrency", type=int, default=None, help="Ray: model actors (default: 1 per GPU, else 1)"
    )
    return sub


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed `foveal batch` command; the exit status."""
    try:
        options = _options(args)
    except ValueError as error:
        return fail(error, 2)
    use_ray = args.ray or bool(os.environ.get("RAY_ADDRESS"))
    try:
        if use_ray:
            from foveal.batch.ray_job import run_on_ray

            summary = run_on_ray(args.input, device=args.device, concurrency=args.concurrency, **options)
        else:
            from foveal.batch.runner import run

            quiet_loading()
            job = run(args.input, model=args.model, device=args.device, **options)
            summary = job.run()
    except (
        ValueError,
        TypeError,
        OSError,
        ImportError,
    ) as error:  # InputError, SchemaError, ModelLoadError...
        return fail(error, 2)
    except RuntimeError as error:  # the model closed under the run
        return fail(error, 1)
    except KeyboardInterrupt:  # Ctrl-C: what is written stays; one line says how to go on
        how = "run the same command again" if args.resume else "run the same command with --resume"
        print(
            f"foveal batch: interrupted; the results written so far are in {args.out}; "
            f"to continue where it stopped, {how}",
            file=sys.stderr,
        )
        return 130
    print(f"foveal batch: {summary.line()} -> {args.out}", file=sys.stderr)
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    check_device(args.device)
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window must be >= 1, got {args.window}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    return {
        "skill": args.skill,
        "object": args.object,
        "question": args.question,
        "length": args.length,
        "prompt": args.prompt,
        "output_type": _schema(args.schema),
        "settings": _json_settings(args.settings),
        "out": args.out,
        "resume": args.resume,
        "allow_changed": args.allow_changed,
        "progress": not args.quiet,
        "window": args.window,
        "column": args.column,
        "key_column": args.key_column,
    }


def _schema(path: str | None) -> Any:
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(
            f"--schema {path} cannot be read ({error.strerror}); name a JSON schema file"
        ) from None
    except ValueError as error:
        raise ValueError(f"--schema {path} is not JSON ({error}); write a JSON schema object") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"--schema {path} holds a {type(schema).__name__}; a JSON schema is an object {{...}}"
        )
    return schema


def _json_settings(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        settings = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--settings is not JSON ({error}); write e.g. '{{\"max_tokens\": 64}}'") from None
    if not isinstance(settings, dict):
        raise ValueError(f"--settings must be a JSON object such as '{{\"max_tokens\": 64}}', got {text}")
    return settings
