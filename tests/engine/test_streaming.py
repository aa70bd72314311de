"""Streaming: UTF-8 safe text deltas, stop-string hold-back, thread-safe submit, the asyncio wrapper."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from tokenizers import Tokenizer

from foveal.engine import AsyncEngine, FinishReason, Request, SamplingParams
from foveal.engine.detokenizer import Detokenizer, native_decoder
from foveal.testing import FakeRunner


def _byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (byte-level alphabet): multi-byte characters span several tokens."""
    table = {b: tokenizer.token_to_id(ch) for b, ch in enumerate(_bytes_to_unicode())}
    return [table[b] for b in text.encode()]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map, which ByteLevel uses."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    by_byte = dict(zip(bs, cs, strict=True))
    return [chr(by_byte[b]) for b in range(256)]


def test_deltas_never_split_a_character(h, tokenizer):
    text = "naïve 日本語 🙂 ok"
    target = _byte_tokens(tokenizer, text)
    assert len(target) > len(text)  # multi-byte characters span several tokens
    with h.engine(tokenizer=tokenizer) as eng:
        handle = eng.submit(Request([1], SamplingParams(max_tokens=60), h.TrieMatcher([target])))
        deltas = list(handle)
        out = handle.result()
    assert out.text == text and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(deltas) > 3  # it streamed, not one blob at the end


def _detokenizers(tokenizer):
    """The three window steps: tokenizers' DecodeStream, the Python one, and through transformers."""
    import transformers

    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, clean_up_tokenization_spaces=False
    )
    assert native_decoder(wrapped) is wrapped.backend_tokenizer
    return {
        "native": lambda stop=(): Detokenizer(tokenizer, stop),
        "python": lambda stop=(): Detokenizer(tokenizer, stop, native=False),
        "transformers": lambda stop=(): Detokenizer(wrapped, stop),
    }


@pytest.mark.parametrize("kind", ["native", "python", "transformers"])
def test_detokenizer_releases_exactly_the_decoded_text(tokenizer, kind):
    make = _detokenizers(tokenizer)[kind]
    rng = random.Random(0)
    for _ in range(50):
        ids = tokenizer.encode(
            rng.choice(["héllo wörld", "日本語のテキスト", "emoji 🚀 🙂 x", '{"x": 0.25}'])
        ).ids
        d = make()
        pieces = []
        for t in ids:
            d.add(t)
            pieces.append(d.release(final=False))
        d.flush()
        pieces.append(d.release(final=True))
        assert "".join(pieces) == tokenizer.decode(ids)


def test_native_and_python_window_steps_release_the_same_text(tokenizer, smollm2_dir):
    """Random ids (split characters, special tokens, ids past the vocabulary) on the test tokenizer
    and on SmolLM2's 49,152-token one: the same delta after every token, the same flushed tail."""
    smollm2 = smollm2_dir / "tokenizer.json"
    rng = random.Random(1)
    for tok in (tokenizer, Tokenizer.from_file(str(smollm2))):
        vocab = tok.get_vocab_size()
        for _ in range(300):
            ids = [rng.randrange(vocab + 8) for _ in range(rng.randint(1, 12))]
            native, python = Detokenizer(tok), Detokenizer(tok, native=False)
            for t in ids:
                native.add(t)
                python.add(t)
                assert native.release(final=False) == python.release(final=False)
            native.flush()
            python.flush()
            assert native.release(final=True) == python.release(final=True)
            assert native.text == python.text == tok.decode(ids, skip_special_tokens=True)


def test_native_decoder_only_where_the_text_is_the_same(tokenizer):
    import transformers

    assert native_decoder(tokenizer) is tokenizer
    cleaned = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, clean_up_tokenization_spaces=True
    )
    assert native_decoder(cleaned) is None  # transformers would post-process the backend's text
    assert native_decoder(object()) is None and native_decoder(None) is None


@pytest.mark.parametrize("kind", ["native", "python", "transformers"])
def test_stop_string_is_held_back_from_the_stream(tokenizer, kind):
    ids = tokenizer.encode("the quick brown fox jumps").ids
    d = _detokenizers(tokenizer)[kind](("fox",))
    streamed = ""
    for t in ids:
        d.add(t)
        streamed += d.release(final=False)
        if d.stopped:
            break
    streamed += d.release(final=True)
    assert streamed == "the quick brown " and d.text == streamed


def test_submit_from_many_threads_matches_a_serial_run(h):
    def req(k, i):
        return Request(
            [1 + k, 2 + i], SamplingParams(max_tokens=1 + (i * 7 + k) % 13, temperature=0.9, seed=k * 100 + i)
        )

    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1)) as eng:
        serial = {(k, i): eng.generate([req(k, i)])[0].token_ids for k in range(4) for i in range(10)}
    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001), max_batch=6) as eng:
        handles = {}

        def worker(k):
            for i in range(10):
                handles[(k, i)] = eng.submit(req(k, i))

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert {key: hd.result(30).token_ids for key, hd in handles.items()} == serial


def test_asyncio_wrapper(h, tokenizer):
    async def main(eng):
        aeng = AsyncEngine(eng)
        outs = await asyncio.gather(
            *[
                aeng.generate(Request([i + 1], SamplingParams(max_tokens=8, ignore_eos=True, seed=i)))
                for i in range(5)
            ]
        )
        deltas = [d async for d in aeng.stream(Request([3], SamplingParams(max_tokens=8, ignore_eos=True)))]
        # closing a stream early cancels its request
        stream = aeng.stream(Request([4], SamplingParams(max_tokens=250, ignore_eos=True)))
        async for _ in stream:
            break
        await stream.aclose()
        return outs, deltas

    with h.engine(tokenizer=tokenizer, runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001)) as eng:
        outs, deltas = asyncio.run(main(eng))
        assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages
        sync = eng.generate([Request([3], SamplingParams(max_tokens=8, ignore_eos=True))])[0]
    assert all(len(o.token_ids) == 8 and o.finish_reason is FinishReason.LENGTH for o in outs)
    assert "".join(deltas) == sync.text


class CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notifies = 0

    def notify_all(self) -> None:
        self.notifies += 1
        super().notify_all()


def test_deltas_wake_only_callers_that_iterate():
    """A caller blocked in result() is not woken by each delta (it would take the GIL from the
    engine every step); one iterating the handle is, and the finish wakes both."""
    from foveal.engine import RequestHandle, RequestOutput

    handle = RequestHandle(0, lambda rid: None)
    handle._cond = cond = CountingCondition()
    waiter = threading.Thread(target=handle.result)
    waiter.start()
    while not cond._waiters:  # the waiter is blocked in result()
        time.sleep(0.001)
    for _ in range(20):
        handle._push("x")
    assert cond.notifies == 0

    seen = []
    reader = threading.Thread(target=lambda: seen.extend(handle))
    reader.start()
    while len(cond._waiters) < 2:  # the reader has taken the 20 deltas and waits for more
        time.sleep(0.001)
    handle._push("y")
    assert cond.notifies == 1
    handle._finish(RequestOutput([], "x" * 20 + "y", FinishReason.STOP, 1))
    waiter.join(5)
    reader.join(5)
    assert not waiter.is_alive() and not reader.is_alive()
    assert "".join(seen) == "x" * 20 + "y"
