"""The runner's and paged attention's invariants (engine/models/runner.py, attention.py)."""

import dataclasses

import pytest
import torch

from foveal.engine.models.traced import bucket
from foveal.families import load
from foveal.testing import parity, tiny


def test_forward_before_allocate_kv_raises(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu")
    batch = parity.make_batch([([1, 2, 3], 0, [0], None)], 4, "cpu")
    with pytest.raises(RuntimeError, match="allocate_kv"):
        loaded.runner.forward(batch)


def test_only_named_slots_are_written_and_garbage_elsewhere_is_never_attended(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu")
    runner = loaded.runner
    prompts = [loaded.processor(p) for p in tiny.PROMPTS[:3]]
    clean = parity.greedy(runner, prompts, 4).logits
    # Same run over a pool full of large finite garbage: results must not change, unnamed pages must not be written.
    runner.allocate_kv(64, 4)
    for t in runner.kv.k + runner.kv.v:
        t.fill_(1e4)
    items = [
        (p.token_ids, 0, [40 - 3 * j - i for j in range(5)], None) for i, p in enumerate(prompts)
    ]  # interleaved
    logits = runner.forward(parity.make_batch(items, 4, "cpu"))
    for row in range(3):
        assert torch.allclose(logits[row], clean[row][0], atol=1e-5)
    written = {s // 4 for s in parity.make_batch(items, 4, "cpu").kv_index.tolist()}
    for page in set(range(64)) - written:
        assert bool((runner.kv.k[0][page * 4 : page * 4 + 4] == 1e4).all())


def test_prefill_and_decode_mixed_in_one_launch_match_separate_launches(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu")
    runner = loaded.runner
    first, second = (loaded.processor(p) for p in tiny.PROMPTS[2:4])
    alone = parity.greedy(runner, [second], 1).logits[0][0]
    runner.allocate_kv(32, 4)
    logits = runner.forward(parity.make_batch([(first.token_ids, 0, [0, 1, 2, 3, 4, 5], None)], 4, "cpu"))
    token = int(logits[0].argmax())
    decode = ([token], len(first.token_ids), [0, 1, 2, 3, 4, 5], None)
    prefill = (second.token_ids, 0, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], None)
    mixed = runner.forward(parity.make_batch([decode, prefill], 4, "cpu"))
    reference = parity.greedy(runner, [first], 2).logits[0][1]
    assert torch.allclose(mixed[0], reference, atol=1e-5)
    assert torch.allclose(mixed[1], alone, atol=1e-5)


def test_paligemma_prefix_is_bidirectional(checkpoints):
    """Turning the prefix mask off changes the logits: the test above would notice a causal-only runner."""
    loaded = load(checkpoints["paligemma"], device="cpu")
    prompts = tiny.family_prompts(loaded)[:3]
    prefix = parity.greedy(loaded.runner, prompts, 1).logits
    loaded.runner.arch = dataclasses.replace(loaded.runner.arch, prefix_attention=False)
    causal = parity.greedy(loaded.runner, prompts, 1).logits
    assert max(float((a[0] - b[0]).abs().max()) for a, b in zip(prefix, causal, strict=True)) > 1e-3


@pytest.mark.parametrize("family", ["paligemma", "llava"])
def test_images_are_encoded_once_in_prefill_and_never_in_decode(family, checkpoints):
    loaded = load(checkpoints[family], device="cpu")
    calls = []
    loaded.runner.model.model.vision_tower.register_forward_hook(lambda *_: calls.append(1))
    prompts = tiny.family_prompts(loaded)[:5]
    out = parity.greedy(loaded.runner, prompts, 4)
    assert max(len(t) for t in out.tokens) > 1  # decode launches did run
    assert len(calls) == 1  # one encoder call, in the single prefill launch, for all five images


@pytest.mark.parametrize("family", ["llama", "idefics3"])
def test_traced_decode_replays_match_eager_decode(family, checkpoints):
    loaded = load(checkpoints[family], device="cpu")
    prompts = tiny.family_prompts(loaded)[:5]  # 5 sequences: padded into the 6-row bucket
    traced = parity.greedy(parity.trace_in_launch(loaded.runner), prompts, 6)
    assert loaded.runner.decode_graphs.graphs, "decode launches did not go through a traced graph"
    loaded.runner.decode_graphs = None
    eager = parity.greedy(loaded.runner, prompts, 6)
    assert traced.tokens == eager.tokens
    assert traced.logits_close(eager)


def test_bucket_is_the_next_power_of_two_or_three_times_one():
    assert [bucket(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    assert all(n <= bucket(n) < 1.5 * n or bucket(n) == n for n in range(1, 2000))


def test_traced_padding_rows_write_only_the_scratch_page(checkpoints):
    runner = parity.trace_in_launch(load(checkpoints["llama"], device="cpu").runner)
    runner.allocate_kv(16, 4)
    for t in runner.kv.k:
        t.fill_(7.0)
    items = [([5], 2, [3], None), ([6], 5, [8, 1], None), ([9], 0, [12], None), ([4], 1, [13], None)]
    batch = parity.make_batch(items + [([2], 6, [14, 15], None)], 4, "cpu")
    runner.forward(batch)  # 5 rows -> bucket of 6: one padding row
    assert set(runner.decode_graphs.graphs) == {(6, 2)}
    changed = (runner.kv.k[0] != 7.0).any(dim=(1, 2)).nonzero().flatten().tolist()
    scratch = list(range(16 * 4, 17 * 4))
    assert set(changed) - set(scratch) == set(batch.kv_index.tolist())
    assert set(changed) & set(scratch)  # the padding row wrote there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_tensors_start_as_zeros_in_the_runners_dtype(dtype):
    from foveal.engine.models.attention import kv_zeros

    kv = kv_zeros((64, 3, 8), dtype, torch.device("cpu"))
    assert kv.dtype == dtype and kv.shape == (64, 3, 8) and not bool(kv.any())
    kv.index_copy_(0, torch.tensor([5]), torch.ones(1, 3, 8, dtype=dtype))  # writable in place
    assert float(kv.float().sum()) == 24.0


def test_a_new_bucket_runs_eager_while_its_graph_is_traced_in_the_background(checkpoints):
    """The default tracer: the launch that meets a bucket gets the eager forward's logits at once;
    the trace, run on an all-padding batch beside it, writes only the scratch page; later launches
    of the bucket replay it with the same logits."""
    runner = load(checkpoints["llama"], device="cpu").runner
    runner.allocate_kv(16, 4)
    for t in runner.kv.k:
        t.fill_(7.0)
    items = [([5], 2, [3], None), ([6], 5, [8, 1], None), ([9], 0, [12], None), ([4], 1, [13], None)]
    batch = parity.make_batch(items + [([2], 6, [14, 15], None)], 4, "cpu")
    eager = runner._eager(batch, runner.kv.k, runner.kv.v)
    first = runner.forward(batch)
    assert torch.equal(first, eager)  # the eager forward, not a trace made in the launch
    runner.decode_graphs.wait()
    assert set(runner.decode_graphs.graphs) == {(6, 2)}
    changed = (runner.kv.k[0] != 7.0).any(dim=(1, 2)).nonzero().flatten().tolist()
    scratch = list(range(16 * 4, 17 * 4))
    assert set(changed) - set(scratch) == set(batch.kv_index.tolist())
    calls = []
    runner.decode_graphs.eager = lambda *a: calls.append(1)  # a replay never calls the eager forward
    assert torch.allclose(runner.forward(batch), eager, atol=1e-5) and not calls
