"""The `foveal` command line: one sub-command per skill, plus `--version` and `--help`."""

from __future__ import annotations

import argparse
import sys

import foveal


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foveal",
        description="Vision-language models with structured output (boxes, points, JSON, regex, grammars).",
    )
    parser.add_argument("--version", action="version", version=f"foveal {foveal.__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stdout)
        return 0
    return 0
