"""Decode graphs (engine/models/traced.py): one graph per rows bucket serves every table width,
graphs prepared when the KV is allocated, and replays that give the eager forward's logits."""

import pytest
import torch

from foveal.engine.models.traced import DecodeGraphs, script_objects
from foveal.families import load
from foveal.testing import parity


def _decode(width: int, rows: int = 1, page_size: int = 4) -> object:
    """A decode batch of `rows` sequences, each with `width` pages and its last token in the last page."""
    items = []
    for row in range(rows):
        table = [row * width + page for page in range(width)]
        items.append(([3 + row], (width - 1) * page_size + 1, table, None))
    return parity.make_batch(items, page_size, "cpu")


def _filled(runner, pages: int = 64, page_size: int = 4) -> None:
    runner.allocate_kv(pages, page_size)
    generator = torch.Generator().manual_seed(0)
    for t in runner.kv.k + runner.kv.v:
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))


@pytest.mark.parametrize(("family", "lean"), [("llama", True), ("llama", False), ("idefics3", True)])
def test_one_graph_per_rows_bucket_replays_every_width_like_eager(checkpoints, family, lean):
    loaded = load(checkpoints[family], device="cpu")
    runner = loaded.runner
    if not lean:
        runner.lean = None  # transformers' own forward is what gets traced
    runner.decode_graphs = DecodeGraphs(runner._eager, runner.model, background=False)
    _filled(runner)
    for rows in (1, 3):
        for width in (1, 2, 5, 9):
            batch = _decode(width, rows)
            eager = runner._eager(batch, runner.kv.k, runner.kv.v)
            replay = runner.forward(batch)
            assert torch.allclose(replay, eager, atol=1e-5), (rows, width)
    graphs = runner.decode_graphs.graphs
    assert {key[0] for key in graphs} == {1, 3}
    assert len({id(g) for g in graphs.values()}) == 2  # traced once per rows bucket, not per width


def test_prepared_buckets_are_traced_when_the_kv_is_allocated(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu")
    runner = loaded.runner
    graphs = runner.decode_graphs = DecodeGraphs(
        runner._eager, runner.model, kv=lambda: runner.kv, prepare=(1, 2)
    )
    graphs.clear()  # before any KV: nothing to trace on
    assert not graphs._pending
    _filled(runner)
    graphs.wait()
    assert set(graphs.graphs) == {(1, 1), (2, 1)}
    calls = []
    eager, runner.decode_graphs.eager = runner._eager, lambda *a: calls.append(1)
    batch = _decode(6)
    replay = runner.forward(batch)
    assert not calls  # the first decode call of the process replays a prepared graph
    assert torch.allclose(replay, eager(batch, runner.kv.k, runner.kv.v), atol=1e-5)


def test_prepared_traces_write_only_the_scratch_page(checkpoints):
    runner = load(checkpoints["llama"], device="cpu").runner
    runner.decode_graphs = DecodeGraphs(runner._eager, runner.model, kv=lambda: runner.kv, prepare=(1,))
    runner.allocate_kv(16, 4)
    before = [t.clone() for t in runner.kv.k]
    runner.decode_graphs.wait()
    scratch = slice(16 * 4, 17 * 4)
    for old, new in zip(before, runner.kv.k, strict=True):
        assert torch.equal(old[: scratch.start], new[: scratch.start])


def test_a_trace_reaches_the_fp16_packs_without_scripting_the_model(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu", quantize="fp16")
    packs = script_objects(loaded.runner.model)
    assert packs and all(isinstance(p, torch.ScriptObject) for p in packs)
    runner = loaded.runner
    runner.decode_graphs = DecodeGraphs(runner._eager, runner.model, background=False)
    _filled(runner)
    batch = _decode(3)
    assert torch.allclose(runner.forward(batch), runner._eager(batch, runner.kv.k, runner.kv.v), atol=1e-5)
    graph = runner.decode_graphs.graphs[(1, 3)]
    assert not list(graph.children())  # the model's modules were not scripted into the graph


def test_a_trace_changes_no_warning_filter_and_shows_none_of_its_own_warnings(checkpoints, monkeypatch):
    """Traces run on a background thread: they must leave the process's warning filters alone
    (a warnings.catch_warnings there silenced every thread's warnings while a trace ran, and
    dropped filters set meanwhile), while the TracerWarnings foveal's modules cause stay hidden."""
    import warnings

    from foveal.engine.models.traced import TRACE_WARNINGS

    loaded = load(checkpoints["llama"], device="cpu", quantize="fp16")  # HalfLinear reads a traced row count
    runner = loaded.runner
    runner.decode_graphs = DecodeGraphs(runner._eager, runner.model, background=False)
    _filled(runner)
    during, trace = [], torch.jit.trace

    def spy(*args, **kwargs):
        during.append(list(warnings.filters))
        return trace(*args, **kwargs)

    def others(filters):  # the filters that are not the trace's own
        own = {(spec["category"], spec["module"]) for spec in TRACE_WARNINGS}
        return [f for f in filters if (f[2], getattr(f[3], "pattern", f[3])) not in own]

    monkeypatch.setattr(torch.jit, "trace", spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("error", category=FutureWarning, module="somebody_elses")
        before = list(warnings.filters)
        runner.forward(_decode(2, rows=2))
        after = list(warnings.filters)
    # the trace's own filters may be there before it (an earlier test's background trace put them in front)
    assert len(during) == 1 and others(during[0]) == others(after) == others(before)
    tracer = [(w.filename, w.lineno) for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    assert not tracer
