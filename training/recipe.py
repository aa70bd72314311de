"""The embedded model's whole training, one command: `python -m foveal.training.recipe --root runs/recipe --export OUT`.

PROBLEM
    The shipped weights come from several runs, each warm-started from the one before with its own
    steps, learning rate and task mix (docs/models/shapes.md lists them). Repeating them by hand
    means copying six command lines and the exports between them without a slip.
SOLUTION
    `STAGES` holds those runs as data; `main` runs them in order through `train_shapes.main`, each
    in its own folder under --root, warm-started from the previous stage's checkpoint or export.
    Every stage resumes from its own last.pt, so an interrupted recipe continues where it stopped
    when the same command runs again; a finished stage is a no-op. The last stage's run is
    exported to --export (sdk/embedded to replace the shipped model).
INVARIANTS (tests/training/test_recipe.py)
    - The stages' commands are exactly what docs/models/shapes.md gives for them.
    - A stage starts from the stage before it: its init_from names that stage's folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from foveal.training import train_shapes

AUX = {"aux_weight": 0.5}
CAPTION_MIX = {"detect": 0.3, "point": 0.15, "caption": 0.35, "query": 0.2}
CHAT_MIX = {"detect": 0.3, "point": 0.15, "caption": 0.3, "query": 0.2, "chat": 0.8}
TOOL_KINDS = {"conversation": 0.25, "tool_call": 0.3, "tool_result": 0.3, "json": 0.15}
TALK_MIX = {"detect": 0.3, "point": 0.15, "caption": 0.45, "query": 0.2, "chat": 0.8}
TALK_KINDS = {"conversation": 0.25, "follow_up": 0.2, "tool_call": 0.1, "tool_result": 0.3, "json": 0.15}
AGENT_MIX = {"detect": 0.3, "point": 0.15, "caption": 0.45, "query": 0.2, "chat": 0.9}
RELAY_KINDS = {
    "conversation": 0.15,
    "follow_up": 0.15,
    "tool_call": 0.1,
    "tool_result": 0.3,
    "json": 0.05,
    "answer_tool": 0.25,
}
AGENT_KINDS = {
    "conversation": 0.25,
    "follow_up": 0.2,
    "tool_call": 0.1,
    "tool_result": 0.15,
    "json": 0.1,
    "answer_tool": 0.2,
}


@dataclass(frozen=True, slots=True)
class Stage:
    """One run: its schedule length, where it stops, threads, config overrides, and how it starts
    from the stage before ("checkpoint": that run's last.pt; "export": its exported folder)."""

    name: str
    steps: int
    config: dict = field(default_factory=dict)
    stop_at: int | None = None
    threads: int = 1
    start: str | None = "export"
    then_steps: int | None = None  # resumed once more with this schedule (a second cosine cycle)


STAGES = (
    Stage("1-base", 5000, {}, stop_at=1000, start=None),
    Stage("2-aux", 3000, {**AUX, "warmup": 100}, start="checkpoint"),
    Stage("3-aux", 1500, {**AUX, "warmup": 50, "lr": 0.0004}, threads=2),
    Stage(
        "4-captions",
        4000,
        {**AUX, "warmup": 50, "lr": 0.0004, "task_weights": CAPTION_MIX},
        threads=2,
        then_steps=7000,
    ),
    Stage("5-chat", 1600, {**AUX, "warmup": 100, "lr": 0.0003, "task_weights": CHAT_MIX}, stop_at=1000, threads=2),
    Stage(
        "6-tools",
        1600,
        {**AUX, "warmup": 50, "lr": 0.0003, "task_weights": CHAT_MIX, "chat_kinds": TOOL_KINDS},
        threads=2,
        start="checkpoint",
    ),
    Stage(
        "7-talk",
        1400,
        {**AUX, "warmup": 50, "lr": 0.0002, "task_weights": TALK_MIX, "chat_kinds": TALK_KINDS},
        stop_at=600,
        threads=2,
        start="checkpoint",
    ),
    Stage(
        "8-agents",
        1200,
        {**AUX, "warmup": 50, "lr": 0.0002, "task_weights": AGENT_MIX, "chat_kinds": AGENT_KINDS},
        threads=2,
        start="checkpoint",
    ),
    Stage(
        "9-relay",
        1000,
        {**AUX, "warmup": 50, "lr": 0.00015, "task_weights": AGENT_MIX, "chat_kinds": RELAY_KINDS},
        threads=2,
        start="checkpoint",
    ),
)


def commands(root: Path, export: str | None = None) -> list[list[str]]:
    """The train_shapes command lines of the recipe, in order: each stage's last one exports its
    run to <run>/export (what the next stage starts from); `export`: the last stage's run, again."""
    out: list[list[str]] = []
    previous: Path | None = None
    for stage in STAGES:
        run = root / stage.name
        config = dict(stage.config)
        if stage.start is not None:
            if previous is None:
                raise ValueError(f"stage {stage.name} starts from a stage before it, and it is the first")
            config["init_from"] = str(
                previous / "last.pt" if stage.start == "checkpoint" else previous / "export"
            )
        base = ["--run", str(run), "--threads", str(stage.threads)]
        first = [*base, "--steps", str(stage.steps), "--config", json.dumps(config)]
        if stage.stop_at is not None:
            first += ["--stop-at", str(stage.stop_at)]
        out.append(first)
        if stage.then_steps is not None:
            out.append([*base, "--steps", str(stage.then_steps)])
        out[-1] = [*out[-1], "--export", str(run / "export")]
        previous = run
    if export is not None:
        out.append([*out[-1][: out[-1].index("--export")], "--export", export])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m foveal.training.recipe", description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/recipe", help="folder of the stages' runs")
    p.add_argument(
        "--export", default=None, help="export the last stage here (sdk/embedded: the shipped model)"
    )
    p.add_argument("--print", action="store_true", help="print the commands instead of running them")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for argv_ in commands(Path(args.root), args.export):
        if args.print:
            print("python -m foveal.training.train_shapes " + " ".join(_quoted(a) for a in argv_))
        else:
            train_shapes.main(argv_)


def _quoted(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in ' {"') else arg


if __name__ == "__main__":
    main()
