"""Observability: `engine.stats()`, the Chrome trace of the timeline, and each output's `Timings`."""

from __future__ import annotations

import json
import time

import pytest

from foveal.engine import Request, SamplingParams, Timings
from foveal.testing import FakeRunner


def test_stats_count_what_ran(h):
    # one token a step (no decode bursts): the counts below are per step
    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.002), decode_burst=1) as eng:
        outs = eng.generate(
            [Request([i + 1], SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(4)]
        )
        s = eng.stats()
    assert s["tokens"] == sum(len(o.token_ids) for o in outs) == 40
    assert s["prefill_rows"] == 4 and s["steps"] >= 10
    assert s["forward_ms"] >= 2.0  # the fake forward sleeps 2 ms
    assert 0 < s["device_busy_fraction"] <= 1 and s["bubble_s"] >= 0
    assert s["tokens_per_s"] > 0 and set(s["phase_ms_per_step"]) == {
        "launch",
        "commit",
        "finalize",
        "text",
        "wait",
    }


def test_reset_stats(h):
    with h.engine() as eng:
        eng.generate([Request([1], SamplingParams(max_tokens=3, ignore_eos=True))])
        eng.reset_stats()
        assert eng.stats()["tokens"] == 0 and eng.stats()["steps"] == 0


def test_chrome_trace(h, tmp_path):
    with h.engine(trace=True, runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001), decode_burst=1) as eng:
        eng.generate([Request([1], SamplingParams(max_tokens=5, ignore_eos=True))])
        eng.trace.write(tmp_path / "trace.json")
    data = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"launch", "commit", "finalize", "wait", "forward", "sample", "copy"} <= names
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert sum(e["name"] == "forward" for e in spans) == 5


def test_trace_off_records_nothing(h):
    with h.engine() as eng:
        eng.generate([Request([1], SamplingParams(max_tokens=3, ignore_eos=True))])
        assert [e for e in eng.trace.to_chrome()["traceEvents"] if e["ph"] == "X"] == []


@pytest.mark.parametrize("pipelined", [True, False])
def test_text_runs_after_the_next_finalize(h, tokenizer, pipelined):
    """Pipelined: commit t, finalize t+1, then the text of t (detokenizing is not on the path from
    commit t to sample t+1). Blocking: finalize t, then commit t and its text."""
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001)
    with h.engine(pipelined, runner, tokenizer, trace=True, decode_burst=1) as eng:
        eng.generate([Request([i + 1], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(3)])
        names = [s[0] for s in sorted(eng.trace._spans, key=lambda s: s[2]) if s[1] == "scheduler"]
    names = [n for n in names if n != "wait"]
    triples = {tuple(names[i : i + 3]) for i in range(len(names) - 2)}
    if pipelined:
        assert names.count("text") >= 10 and ("commit", "finalize", "text") in triples
        assert ("commit", "text", "finalize") not in triples
    else:
        assert ("finalize", "commit", "text") in triples and ("commit", "text", "finalize") not in triples


@pytest.mark.parametrize("pipelined", [True, False])
def test_each_output_carries_its_timings(h, pipelined):
    """Queued + prefill is the time to the first token; prefill covers at least one forward, decode
    the other forwards of a 6-token answer; the spans add up to about the request's wall time."""
    with h.engine(pipelined=pipelined, runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.01)) as eng:
        started = time.perf_counter()
        out = eng.submit(Request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))).result()
        wall = time.perf_counter() - started
    t = out.timings
    assert isinstance(t, Timings) and min(t.queued_s, t.prefill_s, t.decode_s) >= 0
    assert t.ttft_s == t.queued_s + t.prefill_s
    assert t.prefill_s >= 0.01 and t.decode_s >= 4 * 0.01
    assert t.ttft_s + t.decode_s <= wall


def test_timings_of_a_request_that_never_started():
    never_admitted = Timings.of(submitted=1.0, admitted=0.0, first_token=0.0, finished=3.0)
    assert (never_admitted.queued_s, never_admitted.prefill_s, never_admitted.decode_s) == (2.0, 0.0, 0.0)
    no_token = Timings.of(submitted=1.0, admitted=1.5, first_token=0.0, finished=3.0)
    assert (no_token.queued_s, no_token.prefill_s, no_token.decode_s) == (0.5, 1.5, 0.0)
