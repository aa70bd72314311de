"""The engine's declared interfaces (matcher.py, runner.py, regions.py, device.py): what does not
implement a required protocol is refused where it enters the engine, with a TypeError naming what
it lacks; optional capabilities are resolved there once and never looked up on a step; and the
pipeline routes `OwnMask` rows and region rows by what was resolved."""

from __future__ import annotations

import pytest
import torch

from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.engine.device import CpuDevice, Device
from foveal.engine.matcher import ForcedTokens, Matcher, OwnMask, conforms, fill_masks_each, missing
from foveal.engine.pipeline import Pipeline
from foveal.engine.regions import RegionHeads, RegionSteps, stage_kinds
from foveal.engine.request import FinishReason
from foveal.engine.runner import ModelRunner, Quiesce
from foveal.engine.trace import Trace
from foveal.testing import FakeRunner
from foveal.testing.manual_device import ManualDevice
from tests.engine.test_pipeline_steps import EOS, VOCAB, add, assert_idle_and_free, make_pipeline, run_to_idle

OPTIONAL_MATCHER = {"forced_tokens", "ends_after", "step_kind", "fills_own_mask"}
OPTIONAL_RUNNER = {"last_hidden", "sample_regions", "quiesce"}


# ---- refused where they enter -----------------------------------------------------------------------------


class HalfRunner:
    """Sizes itself like a runner but has no allocate_kv and no forward."""

    vocab_size = VOCAB
    device = torch.device("cpu")
    max_positions = None

    def kv_bytes_per_token(self) -> int:
        return 8


def test_an_engine_refuses_a_runner_that_lacks_required_methods_and_names_them():
    with pytest.raises(
        TypeError, match=r"HalfRunner does not implement ModelRunner: it lacks allocate_kv, forward"
    ):
        Engine(HalfRunner(), None, EngineConfig(num_pages=16, max_model_len=32))


def test_submit_refuses_a_matcher_that_lacks_a_required_method_and_the_engine_keeps_serving(h):
    class NoEnd:
        def commit(self, token_id):
            pass

        def fill_mask(self, bitmask, row):
            bitmask[row] = -1

    with h.engine() as eng:
        with pytest.raises(
            TypeError, match=r"NoEnd does not implement Matcher: it lacks is_terminated; implement it"
        ):
            eng.submit(Request([1], SamplingParams(max_tokens=3), NoEnd()))
        out = eng.generate([Request([1], SamplingParams(max_tokens=3, ignore_eos=True))], timeout=10)[0]
        assert out.finish_reason is FinishReason.LENGTH
        assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages


def test_a_pipeline_refuses_a_device_that_lacks_what_it_calls():
    class NoThreads(ManualDevice):
        threads_for = None  # present but not callable: not a method

    with pytest.raises(TypeError, match=r"NoThreads does not implement Device: it lacks threads_for"):
        make_pipeline_on(NoThreads())


def make_pipeline_on(device) -> Pipeline:
    sizes = dict(max_batch=4, max_step_tokens=64, page_size=4, num_pages=64, max_model_len=64)
    return Pipeline(FakeRunner(vocab_size=VOCAB), device, pipelined=True, fill_masks=fill_masks_each, **sizes)


def test_the_engines_own_implementations_conform(automata):
    device = CpuDevice(Trace(False))
    try:
        assert conforms(device, Device) and conforms(ManualDevice(), Device)
    finally:
        device.close()
    assert conforms(FakeRunner(), ModelRunner) and not conforms(FakeRunner(), RegionHeads)
    grammar_matcher = automata[0][0].matcher()  # foveal.grammars, which cannot import the engine
    assert conforms(grammar_matcher, Matcher) and conforms(grammar_matcher, ForcedTokens)
    assert not conforms(grammar_matcher, RegionSteps) and not conforms(grammar_matcher, OwnMask)
    assert missing(object(), Quiesce) == ["quiesce"]


# ---- resolved once, never looked up on a step -----------------------------------------------------------------


class Watched:
    """Records the attribute names looked up on an instance once `watching` is set."""

    watching = False

    def __getattribute__(self, name):
        if object.__getattribute__(self, "watching"):
            object.__getattribute__(self, "looked_up").append(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_matchers_capabilities_are_resolved_at_submit_and_not_looked_up_on_any_step(h, pipelined):
    class Forcing(Watched, h.TrieMatcher):
        def __init__(self, options):
            super().__init__(options)
            self.looked_up, self.forced_calls = [], 0

        def forced_tokens(self):
            self.forced_calls += 1
            return [60, 61, 62] if not self.tokens else []

        def ends_after(self, tokens):
            return False

    pipe = make_pipeline(pipelined, jump_forward=True)
    matcher = Forcing([[60, 61, 62, 70]])
    seq = add(pipe, [1, 2], max_tokens=10, matcher=matcher, stop=(EOS,))  # the Sequence resolves here
    assert seq.forced_tokens is not None and seq.step_kind is None and not seq.own_mask
    matcher.watching = True
    run_to_idle(pipe)
    assert seq.handle.result(0).token_ids == [60, 61, 62, 70]
    assert matcher.forced_calls >= 1 and pipe.stats.jumps == 1  # the resolved method was used
    assert "fill_mask" in matcher.looked_up and "commit" in matcher.looked_up
    assert not OPTIONAL_MATCHER & set(matcher.looked_up)
    assert_idle_and_free(pipe)


def test_a_runners_capabilities_are_resolved_when_the_engine_is_built_and_not_looked_up_on_any_step(h):
    class Runner(Watched, FakeRunner):
        def __init__(self):
            super().__init__(vocab_size=h.VOCAB, seed=1)
            self.looked_up, self.quiesced = [], 0

        def quiesce(self):
            self.quiesced += 1

    runner = Runner()
    eng = Engine(runner, None, h.config(True))
    runner.watching = True
    try:
        eng.generate(
            [Request([i + 1], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)], timeout=10
        )
    finally:
        eng.close()
    runner.watching = False
    assert "forward" in runner.looked_up and not OPTIONAL_RUNNER & set(runner.looked_up)
    assert runner.quiesced == 1  # Quiesce, resolved at construction, called by close()


# ---- OwnMask: the pipeline fills those rows itself ------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
def test_own_mask_rows_are_filled_by_their_matcher_and_never_reach_fill_masks(h, pipelined):
    class Own(h.TrieMatcher):
        fills_own_mask = True

    handed = []

    def fill_masks(matchers, bitmask):
        assert len(matchers) <= bitmask.shape[0]
        handed.extend(matchers)
        for row, matcher in enumerate(matchers):
            matcher.fill_mask(bitmask, row)

    pipe = make_pipeline(pipelined)
    pipe.fill_masks = fill_masks
    options = [[30, 31, 32], [30, 33]]
    own = [Own(options) for _ in range(2)]
    plain = [h.TrieMatcher(options) for _ in range(2)]
    seqs = [
        add(pipe, [i + 1], max_tokens=8, matcher=m, stop=(EOS,))
        for i, m in enumerate([own[0], *plain, own[1]])
    ]
    run_to_idle(pipe)
    assert handed and all(m in plain for m in handed)  # the batched call saw only the plain matchers
    for seq, matcher in zip(seqs, [own[0], *plain, own[1]], strict=True):
        out = seq.handle.result(0)
        assert out.finish_reason is FinishReason.STOP and matcher.accepts(out.token_ids)
        assert matcher.mask_history == list(range(len(out.token_ids) + 1))  # one mask per step, after commit
    assert_idle_and_free(pipe)


def test_an_own_mask_row_that_fails_fails_only_its_request(h):
    class OwnFailing(h.FailingMatcher):
        fills_own_mask = True

    pipe = make_pipeline()
    broken = add(pipe, [1], max_tokens=6, matcher=OwnFailing(2))
    fine = add(pipe, [2], max_tokens=6, matcher=h.TrieMatcher([[40, 41, 42, 43, 44]]), stop=(EOS,))
    run_to_idle(pipe)
    assert broken.finish_reason is FinishReason.ERROR and "mask limit" in broken.handle.result(0).error
    assert fine.handle.result(0).token_ids == [40, 41, 42, 43, 44]
    assert_idle_and_free(pipe)


# ---- region steps: RegionSteps matchers on a RegionHeads runner -------------------------------------------------

VALUE = 1000  # a region value id: past the vocabulary, as a runner's encoding puts them


class HeadsRunner(FakeRunner):
    """A FakeRunner with region heads: a region row's sample becomes VALUE + its kind."""

    def __init__(self, **kw):
        super().__init__(vocab_size=VOCAB, seed=1, **kw)
        self.last_hidden = None

    def forward(self, batch):
        logits = super().forward(batch)
        self.last_hidden = logits[:, :4]
        return logits

    def sample_regions(self, hidden, kinds, rows, sampled):
        assert hidden.shape[0] == kinds.shape[0]
        sampled.index_copy_(0, rows, VALUE + kinds.index_select(0, rows))


class Alternating:
    """Every other step samples a region value of kind 2; ends after `steps` commits."""

    def __init__(self, steps: int) -> None:
        self.steps, self.committed = steps, []

    def step_kind(self) -> int:
        return 2 if len(self.committed) % 2 else 0

    def commit(self, token_id: int) -> None:
        if (token_id >= VALUE) != (self.step_kind() == 2):
            raise ValueError(f"{token_id} at a step of kind {self.step_kind()}")
        self.committed.append(token_id)

    def fill_mask(self, bitmask, row: int) -> None:
        bitmask[row] = -1

    def is_terminated(self) -> bool:
        return len(self.committed) >= self.steps


@pytest.mark.parametrize("pipelined", [True, False])
def test_region_rows_sample_values_on_the_device_and_token_rows_are_untouched(pipelined):
    pipe = make_pipeline(pipelined, runner=HeadsRunner())
    assert pipe.heads is pipe.runner
    region = add(pipe, [3], max_tokens=12, matcher=Alternating(6))
    tokens = add(pipe, [4], max_tokens=6)
    run_to_idle(pipe)
    ids = region.handle.result(0).token_ids
    assert len(ids) == 6 and ids[1::2] == [VALUE + 2] * 3 and all(t < VOCAB for t in ids[::2])
    assert all(t < VOCAB for t in tokens.handle.result(0).token_ids)
    assert_idle_and_free(pipe)


def test_without_region_heads_every_row_is_a_token_row():
    pipe = make_pipeline(runner=FakeRunner(vocab_size=VOCAB, seed=1))
    assert pipe.heads is None
    seq = add(pipe, [3], max_tokens=3, matcher=Alternating(99))  # its second commit is refused
    run_to_idle(pipe)
    assert seq.finish_reason is FinishReason.ERROR
    assert_idle_and_free(pipe)


def test_stage_kinds_lists_the_region_rows_of_live_sequences():
    pipe = make_pipeline(runner=HeadsRunner())
    region, finalized = Alternating(9), Alternating(9)
    region.committed, finalized.committed = [0], [0]  # both at a kind-2 step
    rows = [add(pipe, [1], 4), add(pipe, [2], 4, matcher=region), add(pipe, [3], 4, matcher=finalized)]
    rows[2].finalized = True
    kinds, listed = [9] * 3, [9] * 3
    assert stage_kinds(rows, kinds, listed) == 1
    assert kinds == [0, 2, 0] and listed[0] == 1
