"""Interpreter exit is clean with engines still open, mid-request included (issue 13, engine/shutdown.py).

Before the fix a script that ended without `close()` while a step was on the device died with
SIGABRT ("terminate called without an active exception"): the device thread, coming back from a
TorchScript replay during finalization, was ended through C++ frames that cannot unwind. Each
case runs a real script in a subprocess and checks its exit status and stderr.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
from torch.multiprocessing.reductions import StorageWeakRef

from foveal.engine import FinishReason, Request, SamplingParams, shutdown

# A runner whose forward is one TorchScript call that keeps the GIL released for ~0.1-0.3 s (a
# traced loop of matmuls), so the device thread is inside native TorchScript code when the main
# thread exits: the condition of the crash, every run, without loading a model.
SLOW_TRACED_ENGINE = """
import atexit, sys, threading, time
finished = {}
# Registered before foveal is imported, so it runs after foveal's handler (atexit is LIFO).
atexit.register(lambda: print("finish:", finished["handle"].result(0).finish_reason, flush=True))

import torch
from foveal.engine import Engine, EngineConfig, Request, SamplingParams

def heavy(x):
    for _ in range(12):
        x = torch.tanh(x @ x)
    return x

graph = torch.jit.trace(heavy, torch.randn(480, 480))

class SlowTracedRunner:
    vocab_size = 32
    device = torch.device("cpu")
    max_positions = None
    x = torch.randn(480, 480)

    def kv_bytes_per_token(self):
        return 8

    def allocate_kv(self, num_pages, page_size):
        pass

    def forward(self, batch):
        graph(self.x)
        return torch.zeros(batch.num_seqs, self.vocab_size)

engine = Engine(SlowTracedRunner(), None, EngineConfig(max_batch=2, num_pages=64, max_model_len=512))
finished["handle"] = engine.submit(Request([1], SamplingParams(max_tokens=500, ignore_eos=True)))
time.sleep(0.5)  # a few steps in: one is on the device now
print("exiting", flush=True)
"""

# The script: the embedded model, a call still running on another thread at exit.
EMBEDDED_CALL_IN_FLIGHT = """
import threading, time
import foveal
from foveal.vision import scenes

image = scenes.render(scenes.generate_scene(1))
model = foveal.load()
print(model.generate(image, "hi", settings={"max_tokens": 8})["text"] is not None, flush=True)

def call():
    try:
        model.generate(image, "hi", settings={"max_tokens": 400})
    except Exception as error:  # ended by the close at exit
        print("in-flight call ended:", type(error).__name__, flush=True)

for _ in range(3):  # a batch of 3 in flight: decode steps long enough to be caught mid-replay
    threading.Thread(target=call, daemon=True).start()
time.sleep(0.3)
print("exiting", flush=True)
"""


def _run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=timeout
    )


def _assert_clean_exit(done: subprocess.CompletedProcess) -> None:
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, f"exit status {done.returncode}; stderr:\n{done.stderr[-2000:]}"
    assert "exiting" in done.stdout


def test_exit_with_a_step_inside_a_traced_replay_is_clean():
    """3 runs (each aborted before the fix); the request in flight ends CANCELLED by the close at exit."""
    for _ in range(3):
        done = _run(SLOW_TRACED_ENGINE)
        _assert_clean_exit(done)
        assert "finish: cancelled" in done.stdout, done.stdout


def test_exit_without_close_with_a_call_in_flight_on_the_embedded_model():
    done = _run(EMBEDDED_CALL_IN_FLIGHT)
    _assert_clean_exit(done)
    assert done.stdout.startswith("True")


class _Closable:
    def __init__(self, fail: bool = False) -> None:
        self.closed, self.fail = 0, fail

    def close(self) -> None:
        self.closed += 1
        if self.fail:
            raise RuntimeError("cannot close")


@pytest.fixture
def registry(monkeypatch):
    """A registry of this test's own: close_all must not close the engines of other tests' fixtures."""
    monkeypatch.setattr(shutdown, "_engines", weakref.WeakSet())


def test_the_registry_holds_engines_weakly(registry):
    engine = _Closable()
    shutdown.register(engine)
    assert shutdown.open_engines() == [engine]
    del engine
    gc.collect()
    assert shutdown.open_engines() == []


def test_close_all_closes_every_engine_even_when_one_fails(registry, capsys):
    engines = [_Closable(), _Closable(fail=True), _Closable()]
    for engine in engines:
        shutdown.register(engine)
    shutdown.close_all()
    assert [e.closed for e in engines] == [1, 1, 1]
    assert "cannot close" in capsys.readouterr().err


def test_a_real_engine_registers_itself_and_closing_it_again_is_harmless(h, registry):
    with h.engine() as engine:
        assert shutdown.open_engines() == [engine]
    shutdown.close_all()  # what the atexit handler does with an engine its user has closed
    assert engine.wait_idle(0)


class _Owner:
    """Stands in for foveal.Model: what users hold, while the engine's threads hold the engine."""


def _is_closed(engine) -> bool:
    try:
        engine.submit(Request([1], SamplingParams(max_tokens=1))).cancel()
    except RuntimeError:
        return True
    return False


def test_an_engine_closes_when_its_owner_is_dropped(h):
    with h.engine() as engine:
        owner = _Owner()
        shutdown.close_with(owner, engine)
        assert not _is_closed(engine)
        del owner
        gc.collect()
        assert _is_closed(engine)


def _device_threads() -> int:
    return sum(t.name == "foveal-device" for t in threading.enumerate())


def test_an_owner_dropped_on_the_engine_thread_is_closed_from_another_thread(h):
    """close() on the engine's own thread cannot join it (the close failed half-way: the device
    thread stayed); the finalizer hands the close to a new thread, which completes it."""
    box = []

    def hook(phase):
        if phase == "commit" and box:
            box.clear()  # the owner's last reference dies on the engine thread

    before = _device_threads()
    with h.engine(debug_hook=hook) as engine:
        owner = _Owner()
        shutdown.close_with(owner, engine)
        box.append(owner)
        del owner
        output = engine.submit(Request([1], SamplingParams(max_tokens=200, ignore_eos=True))).result(10)
        for thread in threading.enumerate():
            if thread.name == "close-dropped-engine":
                thread.join(10)
        assert output.finish_reason is FinishReason.CANCELLED  # closed mid-request by the drop
        assert _is_closed(engine)
        assert _device_threads() == before, "the close did not finish: the device thread still runs"


def test_a_dropped_model_frees_its_weights():
    """The notebook case: `model = foveal.load()` run again without close() (+120 MB a reload before)."""
    import foveal
    from foveal.vision import scenes

    before = set(threading.enumerate())  # engines of other tests' models may still run: not this one's
    model = foveal.load()  # Model.__init__ registers shutdown.close_with(model, model.engine)
    its_threads = [t for t in threading.enumerate() if t not in before and t.name.startswith("foveal-")]
    weights = [StorageWeakRef(p.untyped_storage()) for p in model.family.runner.model.parameters()]
    model.generate(scenes.render(scenes.generate_scene(1)), "hi", settings={"max_tokens": 4})
    model = None
    gc.collect()
    assert all(w.expired() for w in weights)
    assert len(its_threads) == 2 and not [t for t in its_threads if t.is_alive()]
