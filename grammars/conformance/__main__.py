"""CLI: `python -m foveal.grammars.conformance [--suite ...] [--json out.json] [--limit N]`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import bench, cases, jsts, soundness
from .feed import load_tokenizer

SUITES = {"jsts": jsts, "jsonschemabench": bench, "cases": cases, "soundness": soundness}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m foveal.grammars.conformance",
        description="Run the grammar layer against ../shared/conformance.",
    )
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--json", help="write the full results (with every false accept) to this file")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="files per JSONSchemaBench subset / JSTS draft (quick runs); soundness: schemas",
    )
    args = parser.parse_args(argv)
    tok = load_tokenizer()
    names = list(SUITES) if args.suite == "all" else [args.suite]
    results = {}
    for name in names:
        start = time.perf_counter()
        module = SUITES[name]
        if name == "jsts":
            result = module.run(tok, limit_files=args.limit)
        elif name == "jsonschemabench":
            result = module.run(tok, limit=args.limit)
        elif name == "soundness":
            result = module.run(tok, n=args.limit or 1400)
        else:
            result = module.run(tok)
        results[name] = result
        print(module.table(result))
        print(f"({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
