"""compile() from many threads at once (grammars/compiler.py, grammars/cache.py): each spec is built
once and shared, a failed build is shared by its waiters and retried by the next caller, no lock is
held while a build runs, and automata compiled concurrently are the ones compiled one at a time."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future

import numpy as np

from foveal import grammars
from foveal.grammars import cache as cache_module
from foveal.grammars import compiler
from foveal.grammars.automaton import compile_template
from foveal.grammars.cache import LRUCache
from foveal.grammars.specs import grammar_source
from foveal.grammars.tokenizer import tokenizer_handle

EOS = 2
THREADS = 8


def run_threads(target, n: int = THREADS) -> list:
    """Run target(i) on n threads started together; their results (or exceptions) in order."""
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a compile never returned"
    return results


def test_one_spec_compiled_from_many_threads_is_built_once(tok, monkeypatch):
    arrivals, builds = [], []
    all_arrived = threading.Event()

    def counted_source(spec):
        arrivals.append(1)
        if len(arrivals) == THREADS:
            all_arrived.set()
        return grammar_source(spec)

    def slow_compile(*args, **kwargs):
        builds.append(threading.get_ident())
        all_arrived.wait(timeout=30)  # every caller is in compile() while this build is in flight
        return compile_template(*args, **kwargs)

    monkeypatch.setattr(compiler, "grammar_source", counted_source)
    monkeypatch.setattr(compiler, "compile_template", slow_compile)
    spec = grammars.Regex(f"[a-z]+{uuid.uuid4().hex}")
    automata = run_threads(lambda i: grammars.compile(spec, tok, eos_token_id=EOS))
    assert len(builds) == 1
    assert all(a is automata[0] for a in automata), automata


def test_waiters_share_a_failed_build_and_the_next_caller_builds_again(monkeypatch):
    waiting = threading.Event()

    class ObservedFuture(Future):
        def result(self, timeout=None):
            waiting.set()  # a second caller is now waiting for the build in flight
            return super().result(timeout)

    monkeypatch.setattr(cache_module, "Future", ObservedFuture)
    cache: LRUCache[int] = LRUCache(maxsize=4)
    builds = []

    def failing() -> int:
        builds.append(1)
        waiting.wait(timeout=30)
        raise grammars.SchemaError("refused")

    outcomes = run_threads(lambda i: cache.get_or_build("k", failing), n=2)
    assert len(builds) == 1 and all(isinstance(o, grammars.SchemaError) for o in outcomes), outcomes
    assert outcomes[0] is outcomes[1]  # the waiter got the builder's own exception
    assert cache.get_or_build("k", lambda: 7) == 7 and cache.get("k") == 7  # a refusal is not cached


def test_a_build_in_flight_does_not_hold_other_keys():
    cache: LRUCache[str] = LRUCache(maxsize=4)
    started, release = threading.Event(), threading.Event()

    def long_build() -> str:
        started.set()
        release.wait(timeout=30)
        return "long"

    owner = threading.Thread(target=cache.get_or_build, args=("long", long_build))
    owner.start()
    started.wait(timeout=10)
    other = threading.Thread(target=cache.get_or_build, args=("short", lambda: "short"))
    other.start()
    other.join(timeout=10)
    finished_while_long_ran = not other.is_alive() and not release.is_set()
    release.set()
    owner.join(timeout=10)
    assert finished_while_long_ran and cache.get("short") == "short" and cache.get("long") == "long"


def test_a_long_compile_does_not_hold_compiles_of_other_specs(tok, monkeypatch):
    """No lock is held across a compile: a spec compiles while another thread's compile is in flight."""
    started, release = threading.Event(), threading.Event()
    long_spec = grammars.Regex(f"long{uuid.uuid4().hex}")

    def compile_or_wait(handle, source, budget=None):
        if source.pattern == long_spec.pattern:
            started.set()
            release.wait(timeout=30)
        return compile_template(handle, source, budget)

    monkeypatch.setattr(compiler, "compile_template", compile_or_wait)
    owner = threading.Thread(target=grammars.compile, args=(long_spec, tok), kwargs={"eos_token_id": EOS})
    owner.start()
    started.wait(timeout=10)
    short = grammars.compile(grammars.Regex(f"short{uuid.uuid4().hex}"), tok, eos_token_id=EOS)
    in_flight = not release.is_set() and owner.is_alive()
    release.set()
    owner.join(timeout=10)
    assert in_flight and short.kind == "regex"


def specs_with_forced_text(tag: str) -> list:
    """Specs whose first mask needs llguidance to tokenize forced text (the tokenizer wrapper's callback)."""
    return [
        {"type": "object", "properties": {f"key_{tag}": {"type": "integer"}}, "required": [f"key_{tag}"]},
        {"type": "object", "properties": {"name": {"const": f"fixed {tag}"}, "n": {"type": "number"}}},
        {"type": "array", "items": {"enum": [f"{tag}-a", f"{tag}-b"]}, "minItems": 1},
        grammars.Regex(f"prefix {tag} [0-9]{{2,4}}"),
        grammars.CFG(f'start: "({tag}" expr ")"\nexpr: /[0-9]+/ | expr "+" expr'),
        [f"choice {tag} one", f"choice {tag} two"],
    ]


def first_step(template, vocab_size: int) -> tuple:
    copy = template.deep_copy()
    mask = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)
    forced = copy.compute_ff_tokens()
    copy.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return tuple(forced), mask.tobytes()


def test_concurrent_compiles_equal_one_at_a_time_compiles(tok):
    """Many threads compiling different specs at once (each in its own order) get automata whose
    forced tokens and first masks equal those of the same specs compiled alone."""
    tag = uuid.uuid4().hex[:8]
    specs = specs_with_forced_text(tag)

    def compile_all(i: int) -> list:
        order = list(range(len(specs)))[i % len(specs) :] + list(range(len(specs)))[: i % len(specs)]
        done = {k: grammars.compile(specs[k], tok, eos_token_id=EOS) for k in order}
        return [done[k] for k in range(len(specs))]

    results = run_threads(compile_all)
    assert not any(isinstance(r, BaseException) for r in results), results
    handle = tokenizer_handle(tok, eos_token_id=EOS)
    for k, spec in enumerate(specs):
        shared = results[0][k]
        assert all(r[k] is shared for r in results)
        alone = compile_template(handle, grammar_source(spec))
        assert first_step(shared.template, shared.vocab_size) == first_step(alone, shared.vocab_size), spec
