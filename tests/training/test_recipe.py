"""The embedded model's recipe (foveal.training.recipe): its stages chain, and they run through the real CLI."""

import json

from foveal.training import recipe
from foveal.training import train_shapes as ts

from .test_train_shapes import TINY


def test_each_stage_starts_from_the_one_before_and_exports_its_run(tmp_path):
    lines = recipe.commands(tmp_path, export=str(tmp_path / "out"))
    configs = [json.loads(line[line.index("--config") + 1]) for line in lines[:-1] if "--config" in line]
    assert len(configs) == len(recipe.STAGES) and "init_from" not in configs[0]
    for stage, before, config in zip(recipe.STAGES[1:], recipe.STAGES, configs[1:], strict=False):
        source = tmp_path / before.name / ("last.pt" if stage.start == "checkpoint" else "export")
        assert config["init_from"] == str(source)
    assert lines[0][lines[0].index("--stop-at") + 1] == "1000"
    kinds = [recipe.TOOL_KINDS, recipe.TALK_KINDS, recipe.AGENT_KINDS, recipe.RELAY_KINDS]
    assert [c["chat_kinds"] for c in configs[-4:]] == kinds
    assert configs[-5]["task_weights"] == recipe.CHAT_MIX  # the chat stages train the chat data
    assert lines[-1][-2:] == ["--export", str(tmp_path / "out")]


def test_a_shrunk_recipe_runs_end_to_end_and_resumes_as_a_no_op(tmp_path, monkeypatch):
    tiny = {
        **{k: v for k, v in TINY.items() if k != "steps"},
        "batch_size": 2,
        "chat_batch_size": 2,
        "warmup": 1,
    }
    stages = tuple(
        recipe.Stage(
            s.name,
            2,
            {**s.config, **tiny},
            stop_at=1 if s.stop_at else None,
            start=s.start,
            then_steps=3 if s.then_steps else None,
        )
        for s in recipe.STAGES
    )
    monkeypatch.setattr(recipe, "STAGES", stages)
    recipe.main(["--root", str(tmp_path / "runs"), "--export", str(tmp_path / "hf")])
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= ts.EXPORTED_FILES
    log = (tmp_path / "runs" / stages[-1].name / "log.jsonl").read_text()
    recipe.main(["--root", str(tmp_path / "runs")])  # everything done: nothing trains again
    assert (tmp_path / "runs" / stages[-1].name / "log.jsonl").read_text() == log
