"""Engine test helpers: a small byte-level tokenizer, a hand-written trie matcher, engine builders."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from foveal.engine import Engine, EngineConfig, Request, RequestOutput
from foveal.testing import FakeRunner

EOS = 0
VOCAB = 300
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ça va? naïve café",
    "日本語のテキスト 🙂 emoji 🚀 and more",
    '{"x": 0.25, "y": 0.75} [1, 2, 3]',
]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The process on two intra-op threads for the test (the device's count for large launches, and
    the most its ThreadChooser tries), put back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """Byte-level BPE with EOS = 0 and 300 tokens: single bytes split multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.token_to_id("<eos>") == EOS and tok.get_vocab_size() == VOCAB
    return tok


class TrieMatcher:
    """Accepts exactly one of `options` (token id sequences), then EOS. A stand-in for a grammar."""

    def __init__(self, options: list[list[int]], eos: int = EOS) -> None:
        self.options = [list(o) for o in options]
        self.eos = eos
        self.tokens: list[int] = []
        self.mask_history: list[int] = []  # len(self.tokens) at each fill_mask: the step it served

    def _live(self) -> list[list[int]]:
        n = len(self.tokens)
        return [o for o in self.options if o[:n] == self.tokens[:n] and len(o) >= n]

    def allowed(self) -> set[int]:
        if self.is_terminated():
            return set()
        n = len(self.tokens)
        live = self._live()
        return {o[n] for o in live if len(o) > n} | ({self.eos} if any(len(o) == n for o in live) else set())

    def commit(self, token_id: int) -> None:
        if token_id not in self.allowed():
            raise ValueError(f"token {token_id} not allowed after {self.tokens}")
        self.tokens.append(token_id)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.mask_history.append(len(self.tokens))
        bitmask[row].zero_()
        for t in self.allowed():
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == self.eos

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]

    def accepts(self, generated: list[int]) -> bool:
        """Whether `generated` (the output without the final EOS) is one of the options."""
        return generated in self.options


class FailingMatcher:
    """Allows every token and fails to give a mask from its `fail_at`-th mask on (a grammar stuck on a limit)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.masks = fail_at, 0

    def commit(self, token_id: int) -> None:
        pass

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.masks += 1
        if self.masks >= self.fail_at:
            raise RuntimeError("mask limit")
        bitmask[row] = -1

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        pass


def config(pipelined: bool, **kw) -> EngineConfig:
    base = dict(
        pipelined=pipelined,
        eos_token_ids=(EOS,),
        debug=True,
        max_batch=16,
        max_step_tokens=256,
        page_size=4,
        num_pages=512,
        max_model_len=256,
    )
    base.update(kw)
    return EngineConfig(**base)


@contextlib.contextmanager
def engine(
    pipelined: bool = True, runner: FakeRunner | None = None, tokenizer=None, **kw
) -> Iterator[Engine]:
    eng = Engine(runner or FakeRunner(vocab_size=VOCAB, seed=1), tokenizer, config(pipelined, **kw))
    try:
        yield eng
    finally:
        eng.close()


def run_both(
    make_requests, runner_kw: dict | None = None, tokenizer=None, **kw
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Run fresh requests through a pipelined and a blocking engine; return both outputs."""
    results = []
    for pipelined in (True, False):
        runner = FakeRunner(**{"vocab_size": VOCAB, "seed": 1, **(runner_kw or {})})
        with engine(pipelined, runner, tokenizer, **kw) as eng:
            requests: list[Request] = make_requests()
            results.append(eng.generate(requests, timeout=60))
            assert eng.wait_idle(10)
            assert eng.free_pages() == eng.config.num_pages
            assert eng.lanes.num_free == eng.lanes.count
            sliding = eng.pipeline.sliding
            assert sliding is None or sliding.idle  # the sliding-window pool too (engine/sliding.py)
    return results[0], results[1]


def same(a: RequestOutput, b: RequestOutput) -> bool:
    return (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


@pytest.fixture(scope="session")
def h():
    """The helpers above, for test modules (importlib mode cannot import conftest by name)."""
    import types

    return types.SimpleNamespace(
        EOS=EOS,
        VOCAB=VOCAB,
        TrieMatcher=TrieMatcher,
        FailingMatcher=FailingMatcher,
        Recording=Recording,
        config=config,
        engine=engine,
        run_both=run_both,
        same=same,
    )


REGEXES = [r"[a-z]{3,8}( [a-z]{2,6}){0,4}", r"(yes|no|maybe)", r"[0-9]{1,4}(\.[0-9]{1,3})?"]
POINT_SCHEMA = {
    "type": "object",
    "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1},
        "y": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="session")
def automata(tokenizer):
    """Real foveal.grammars automata over the small tokenizer, with a check that an output is accepted."""
    import json
    import re

    from foveal import grammars

    def regex_check(pattern):
        return lambda text: re.fullmatch(pattern, text) is not None

    def point_check(text):
        p = json.loads(text)
        return set(p) == {"x", "y"} and all(0 <= p[k] <= 1 for k in "xy")

    specs = [(grammars.Regex(r), regex_check(r)) for r in REGEXES] + [(POINT_SCHEMA, point_check)]
    return [(grammars.compile(s, tokenizer, eos_token_id=EOS, vocab_size=VOCAB), check) for s, check in specs]


class Recording:
    """Wraps a matcher; records how many tokens it had committed each time a mask was asked for."""

    def __init__(self, matcher) -> None:
        self.matcher, self.count, self.history = matcher, 0, []

    def commit(self, token_id: int) -> None:
        self.matcher.commit(token_id)
        self.count += 1

    def fill_mask(self, bitmask, row: int) -> None:
        self.history.append(self.count)
        self.matcher.fill_mask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)
        self.count -= n
