"""benchmarks/device_check_moondream3.py dry-run on CPU: the MoE section in the default suite (it needs no
fixture), the whole `--quick` run on the moondream3-tiny fixture (../shared: a conformance test), and the
exit codes of a missing device or fixture."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import device_check_moondream3 as check


def test_moe_section_dry_run_writes_agreement_and_timings(tmp_path):
    assert check.main(["--device", "cpu", "--quick", "--sections", "moe", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "device_check_moondream3.json").read_text())
    assert report["ok"] and report["machine"]["torch"] == torch.__version__
    assert {(a["config"], a["dtype"]) for a in report["moe"]["agreement"]} == {
        ("tiny", "torch.float32"), ("tiny", "torch.bfloat16")}
    assert [(t["config"], t["rows"]) for t in report["moe"]["timing"]] == [("tiny", 1), ("tiny", 4)]
    assert all(set(t["ms"]) == set(check.MOE_PATHS) for t in report["moe"]["timing"])


def test_the_real_moe_sizes_are_moondream_3s():
    dim, moe, layers = check.moe_configs()["real"]
    assert (dim, moe.num_experts, moe.experts_per_token, moe.expert_inner_dim, layers) == (2048, 64, 8, 1024, 20)


def test_a_missing_fixture_or_device_exits_2(tmp_path):
    assert check.main(["--device", "cpu", "--fixture", str(tmp_path / "absent"), "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():
        assert check.main(["--out", str(tmp_path)]) == 2


@pytest.mark.slow  # about 45 s on 2 shared cores
def test_quick_dry_run_on_the_fixture(shared_dir, tmp_path):
    fixture = shared_dir / "fixtures" / "moondream3-tiny"
    if not fixture.is_dir():
        pytest.skip(f"the Moondream 3 fixture is absent: {fixture}")
    argv = ["--device", "cpu", "--quick", "--fixture", str(fixture), "--out", str(tmp_path)]
    assert check.main(argv) == 0
    report = json.loads((tmp_path / "device_check_moondream3.json").read_text())
    assert all(row["ok"] for row in report["parity"].values())
    assert report["parity"]["prefill_logits"]["max_diff"] <= check.LOGIT_TOLERANCE
    assert {(r["pipelined"], r["batch"]) for r in report["e2e"]["rows"]} == {(p, b) for p in (True, False) for b in (1, 4)}
