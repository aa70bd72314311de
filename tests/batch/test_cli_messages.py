"""What `foveal batch` tells a person: Ctrl-C ends with one line saying how to resume; counts read right."""

import foveal.batch.runner as runner
from foveal import cli
from foveal.batch.runner import Summary


def test_ctrl_c_ends_with_one_line_that_says_how_to_resume(capsys, monkeypatch, tmp_path):
    class Interrupted:
        def run(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", lambda *args, **kwargs: Interrupted())
    (tmp_path / "in").mkdir()
    out = tmp_path / "results.jsonl"
    status = cli.main(["batch", str(tmp_path / "in"), "--skill", "caption", "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 130
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(out) in err and "--resume" in err
    status = cli.main(["batch", str(tmp_path / "in"), "--skill", "caption", "--out", str(out), "--resume"])
    assert status == 130 and "run the same command again" in capsys.readouterr().err


def test_the_summary_counts_in_the_singular_and_the_plural():
    one = Summary(images=1, skipped=0, done=1, errors=1, seconds=2.0, mean_batch=None, mean_prefill=None, max_batch=None)
    assert one.line().startswith("1 image in 2.0 s") and "1 error" in one.line() and "1 errors" not in one.line()
    two = Summary(images=2, skipped=0, done=2, errors=0, seconds=2.0, mean_batch=None, mean_prefill=None, max_batch=None)
    assert two.line().startswith("2 images in") and "0 errors" in two.line()
