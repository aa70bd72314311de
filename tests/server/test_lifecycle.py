"""`foveal serve` from start to exit (server/run.py's docstring gives the order): arguments and the
port checked before the load, a load that fails ends the process, a client that never finishes its
request is disconnected, the load is quiet with --quiet, and the shutdown answers every call in
flight (a 200 within the grace, a JSON 503 after it) and gives every KV page back.

The shutdown tests run the real server in this process over `Held`, a tiny random-weight model
whose calls start their real engine request at once but hold their answer until the test releases
it: calls stay in flight for as long as a test needs, whatever the speed of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

import foveal
from foveal import cli
from foveal.families.shapes.format import ShapesFormat
from foveal.results import AsyncTextStream
from foveal.server import ServerConfig, create_app
from foveal.server import run as server_run
from foveal.server.background import BackgroundServer
from foveal.testing import tiny
from tests.server.conftest import all_pages_free, data_url, scene

LONG = 480  # tokens a held call asks for: as many as the tiny model has room for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random-weight PaliGemma folder with the shapes skills (as conftest's random_model)."""
    folder = tmp_path_factory.mktemp("lifecycle") / "shapes"
    shutil.copytree(tiny.build_paligemma(folder.parent / "paligemma"), folder)
    ShapesFormat(n_bins=32).save(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(checkpoint):
    loaded = foveal.load(checkpoint, device="cpu", max_batch_size=8, max_model_len=512)
    yield loaded
    loaded.close()


class Held:
    """A Model whose calls start their real engine request at once and hold their answer (a
    stream: every chunk after the first) until `release` is set. Cancelling a held call cancels
    its engine request, as the SDK's own async calls do."""

    def __init__(self, model: foveal.Model) -> None:
        self.model = model
        self.family = model.family
        self.engine = model.engine
        self.release = threading.Event()

    async def agenerate(self, *args):
        return await self._held(self.model.agenerate(*args))

    async def _held(self, call):
        work = asyncio.ensure_future(call)
        try:
            await self.released()
            return await work
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work

    async def achat(self, *args, stream=False):
        if stream:
            result = await self.model.achat(*args, stream=True)
            return {"text": HeldStream(result["text"], self), "output": None}
        return await self._held(self.model.achat(*args))

    async def acaption(self, *args):
        result = await self.model.acaption(*args)
        return {"caption": HeldStream(result["caption"], self)}

    async def aquery(self, *args):
        result = await self.model.aquery(*args)
        return {"answer": HeldStream(result["answer"], self)}

    async def released(self) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.01)


class HeldStream:
    def __init__(self, stream, held: Held) -> None:
        self.stream = stream
        self.held = held
        self.started = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        if self.started:
            await self.held.released()
        self.started = True
        return await self.stream.__anext__()

    async def aclose(self) -> None:
        await self.stream.aclose()

    @property
    def usage(self):
        return self.stream.usage


class HeldInside(Held):
    """Held, but a chat stream waits inside the SDK's own async generator (as a real decode waits
    for its next token there), so that a task iterating the stream is inside that generator: a
    stream closed under such a task refuses ("aclose(): asynchronous generator is already
    running"), which HeldStream, a plain iterator, never does."""

    async def achat(self, *args, stream=False):
        if not stream:
            return await super().achat(*args)
        inner = (await self.model.achat(*args, stream=True))["text"]

        async def chunks():
            try:
                first = True
                async for chunk in inner:
                    if not first:
                        await self.released()
                    first = False
                    yield chunk
                yield inner.usage
            finally:
                await inner.aclose()

        return {"text": AsyncTextStream(chunks()), "output": None}


def chat_stream_body(n: int = 1) -> dict:
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(scene(2))}}]
    return {"messages": [{"role": "user", "content": parts}], "stream": True, "max_tokens": LONG, "n": n}


def statuses(url: str, route: str) -> dict[str, float]:
    """/metrics' request counts of `route` by status."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("foveal_http_requests_total{") and f'route="{route}"' in line:
            out[line.split('status="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def no_error_logged(records) -> list[str]:
    return [r.getMessage() for r in records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.fixture
def log_records():
    """Every record of foveal's and uvicorn's loggers during the test (uvicorn's do not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("foveal.server", "uvicorn", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def generate_body(tokens: int) -> dict:
    return {
        "prompt": "x",
        "image_url": data_url(scene(0)),
        "regex": f"[ab]{{{tokens}}}",
        "settings": {"max_tokens": tokens + 10},
    }


def in_flight(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("foveal_queue_depth "):
            return float(line.split()[1])
    return 0.0


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


class Calls:
    """HTTP calls made on threads; `results[name]` is (status, JSON body) or, for a stream, its data lines."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: dict[str, object] = {}
        self.first_chunk: dict[str, threading.Event] = {}
        self.threads: list[threading.Thread] = []

    def post(self, name: str, path: str, body: dict) -> None:
        def run() -> None:
            response = httpx.post(f"{self.url}{path}", json=body, timeout=120)
            self.results[name] = (response.status_code, response.json())

        self._start(run)

    def stream(self, name: str, path: str, body: dict) -> None:
        self.first_chunk[name] = threading.Event()

        def run() -> None:
            lines = []
            with httpx.stream("POST", f"{self.url}{path}", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line.removeprefix("data: "))
                        self.first_chunk[name].set()
            self.results[name] = lines

        self._start(run)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads), "a call never got its answer"

    def _start(self, run) -> None:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)


def shutting_down(status_and_body) -> bool:
    status, body = status_and_body
    return (
        status == 503
        and {"message", "type", "code"} <= set(body["error"])
        and (body["error"]["code"] == "shutting_down")
    )


# ---- shutdown ------------------------------------------------------------------------------------------------


def test_calls_in_flight_finish_within_the_grace_and_new_ones_get_503(tiny_model):
    held = Held(tiny_model)
    background = BackgroundServer(create_app(held, config=ServerConfig(shutdown_grace_s=120)))
    url = background.__enter__()
    calls = Calls(url)
    calls.post("generate", "/v1/generate", generate_body(8))
    caption = {"image_url": data_url(scene(1)), "stream": True, "settings": {"max_tokens": 8}}
    calls.stream("caption", "/v1/caption", caption)
    wait_for(lambda: in_flight(url) == 2, "two calls in flight")
    stopping = threading.Thread(target=background.stop)
    stopping.start()
    wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "stopping", "/health saying 'stopping'")
    refused = httpx.post(f"{url}/v1/generate", json={"prompt": "x"}, timeout=60)
    assert shutting_down((refused.status_code, refused.json())), refused.text
    assert "no new calls" in refused.json()["error"]["message"]
    held.release.set()
    calls.join()
    stopping.join(timeout=60)
    assert not background.thread.is_alive()
    status, body = calls.results["generate"]
    assert status == 200 and len(body["text"]) == 8
    final = json.loads(calls.results["caption"][-1])  # the stream ended as usual, with its metrics
    assert final["completed"] is True and final["finish_reason"] == "length" and final["metrics"]["output_tokens"] == 8
    assert all_pages_free(tiny_model)


def test_calls_still_in_flight_when_the_grace_ends_get_503_and_free_every_page(tiny_model, log_records):
    held = Held(tiny_model)  # never released: only the shutdown ends these calls
    background = BackgroundServer(create_app(held, config=ServerConfig(shutdown_grace_s=0.2)))
    url = background.__enter__()
    calls = Calls(url)
    for i in range(3):
        calls.post(f"generate{i}", "/v1/generate", generate_body(LONG))
    calls.stream(
        "caption",
        "/v1/caption",
        {"image_url": data_url(scene(1)), "stream": True, "settings": {"max_tokens": LONG}},
    )
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(scene(2))}}]
    chat = {"messages": [{"role": "user", "content": parts}], "stream": True, "max_tokens": LONG}
    calls.stream("chat", "/v1/chat/completions", chat)
    wait_for(lambda: in_flight(url) == 5, "five calls in flight")
    for event in calls.first_chunk.values():
        assert event.wait(60), "a stream sent no chunk"
    background.stop()
    calls.join()
    assert not background.thread.is_alive()
    for i in range(3):
        assert shutting_down(calls.results[f"generate{i}"]), calls.results[f"generate{i}"]
    for name in ("caption", "chat"):
        *_, error, done = calls.results[name]
        assert shutting_down((503, json.loads(error))) and done == "[DONE]", calls.results[name]
    assert all_pages_free(tiny_model)
    assert not [r for r in log_records if r.exc_info or r.levelno >= logging.ERROR], [
        r.getMessage() for r in log_records if r.levelno >= logging.ERROR
    ]


def test_chat_streams_cut_by_the_shutdown_end_with_the_error_event_and_done(tiny_model, log_records):
    """Streams whose choices are inside their generators when the grace ends (issue 38: every one
    was cut mid-body, with a traceback and a 500 each)."""
    held = HeldInside(tiny_model)  # never released
    background = BackgroundServer(create_app(held, config=ServerConfig(shutdown_grace_s=0.2)))
    url = background.__enter__()
    calls = Calls(url)
    for i in range(3):
        calls.stream(f"chat{i}", "/v1/chat/completions", chat_stream_body(n=2))
    wait_for(lambda: in_flight(url) == 3, "three streams in flight")
    for event in calls.first_chunk.values():
        assert event.wait(60), "a stream sent no chunk"
    time.sleep(0.1)  # the choices' pumps are waiting inside their streams
    counted = statuses(url, "/v1/chat/completions")
    background.stop()
    calls.join()
    for i in range(3):
        *_, error, done = calls.results[f"chat{i}"]
        assert shutting_down((503, json.loads(error))) and done == "[DONE]", calls.results[f"chat{i}"]
    assert all_pages_free(tiny_model)
    assert not no_error_logged(log_records), no_error_logged(log_records)
    assert "500" not in counted


def test_a_dropped_chat_stream_is_a_499_logged_in_one_line_and_cancelled(tiny_model, log_records):
    held = HeldInside(tiny_model)  # never released: the client leaves mid-answer
    logger = logging.getLogger("foveal.server")
    level = logger.level
    logger.setLevel(logging.INFO)  # the request lines
    try:
        dropped_twice(tiny_model, held)
    finally:
        logger.setLevel(level)
    assert not no_error_logged(log_records), no_error_logged(log_records)
    lines = [r.getMessage() for r in log_records if "/v1/chat/completions" in r.getMessage()]
    assert len(lines) == 2 and all(" 499 " in line for line in lines), lines


def dropped_twice(tiny_model, held) -> None:
    with BackgroundServer(create_app(held)) as url:
        for _ in range(2):
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_stream_body(n=2), timeout=60) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        break  # one chunk, then the client drops the connection
        wait_for(lambda: in_flight(url) == 0, "the dropped streams ending")
        assert all_pages_free(tiny_model)  # their engine requests were cancelled
        counted = statuses(url, "/v1/chat/completions")
        assert counted.get("499") == 2 and "500" not in counted, counted


# ---- slow clients ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def impatient(tiny_model):
    """A server that gives a client 0.5 s to send a whole request, over a held model."""
    held = Held(tiny_model)
    with BackgroundServer(create_app(held, config=ServerConfig(read_timeout_s=0.5))) as url:
        yield url, held
        held.release.set()


REQUEST_HEAD = (
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n"
)


@pytest.mark.parametrize(
    "sent",
    [b"", REQUEST_HEAD[:30], REQUEST_HEAD, REQUEST_HEAD + b'\r\n{"prompt": '],
    ids=["nothing", "half a head", "a head without its end", "half a body"],
)
def test_a_client_that_never_finishes_its_request_is_disconnected(impatient, sent):
    url, _ = impatient
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(sent)
        raw.settimeout(30)  # far past the server's 0.5 s: without a read timeout recv() waits all of it
        try:
            received = raw.recv(1024)
        except ConnectionResetError:
            received = b""
    assert received == b""  # closed by the server, nothing answered
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_the_read_timeout_ends_when_the_request_is_whole(impatient):
    """A call answered long after its request arrived is not cut by the read timeout."""
    url, held = impatient
    calls = Calls(url)
    calls.post("generate", "/v1/generate", generate_body(4))
    wait_for(lambda: in_flight(url) == 1, "the call in flight")
    time.sleep(1.5)  # three read timeouts, waiting for the answer
    held.release.set()
    calls.join()
    status, body = calls.results["generate"]
    assert status == 200 and len(body["text"]) == 4


# ---- start ---------------------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    """cli.main(argv) on a thread, which must end by itself (a server that would serve 503 for good
    does not)."""
    outcome: list[int] = []
    thread = threading.Thread(target=lambda: outcome.append(cli.main(argv)), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert outcome, f"foveal {' '.join(argv)} did not exit"
    return outcome[0]


def one_error_line(capsys) -> str:
    """The one line on stderr, besides the request log (the tests' own GET /health)."""
    out, err = capsys.readouterr()
    assert "serving on" not in out
    lines = [line for line in err.splitlines() if " foveal.server INFO GET /health " not in line]
    assert len(lines) == 1 and lines[0].startswith("foveal: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--model", "/nonexistent/model"], "no such folder or file"),
        (["--max-batch-size", "0"], "--max-batch-size 0"),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--port", "70000"], "--port 70000"),
        (["--read-timeout", "0"], "read_timeout_s"),
    ],
)
def test_bad_arguments_exit_2_in_one_line_before_anything_loads(capsys, argv, says):
    assert run_cli(["serve", "--port", "0", "--device", "cpu", *argv]) == 2
    assert says in one_error_line(capsys)


def test_a_port_in_use_exits_2_in_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert run_cli(["serve", "--port", str(port), "--device", "cpu"]) == 2
    assert "in use" in one_error_line(capsys)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def test_a_failed_load_exits_1_in_one_line_after_health_said_loading(capsys):
    port = free_port()
    go = threading.Event()

    def loader():
        go.wait(60)
        raise foveal.ModelLoadError("the weights are corrupt\nsecond line; download them again")

    outcome: list[int] = []
    serving = threading.Thread(
        target=lambda: outcome.append(server_run.serve(loader, "127.0.0.1", port, ServerConfig())),
        daemon=True,
    )
    serving.start()
    wait_for(lambda: _health(port) == "loading", "/health saying 'loading'")
    go.set()
    serving.join(timeout=60)
    assert outcome == [1]
    line = one_error_line(capsys)
    assert "could not be loaded" in line and "download them again" in line


def _health(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health").json()["status"]
    except httpx.HTTPError:
        return None


# ---- a quiet load ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def noisy_checkpoint(checkpoint, tmp_path_factory):
    """The checkpoint with one weight no layer uses: transformers warns about it on every load."""
    folder = tmp_path_factory.mktemp("noisy") / "shapes"
    shutil.copytree(checkpoint, folder)
    weights = load_file(folder / "model.safetensors")
    weights["unused.extra.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def serve_one_call(argv: list[str]) -> int:
    """`foveal serve` (cli.main) on this thread: once /health says "ok", one call (its first trace
    logs too), then SIGTERM."""
    port = free_port()

    def call_then_stop() -> None:
        try:
            wait_for(lambda: _health(port) == "ok", "/health saying 'ok'", timeout=120)
            httpx.post(f"http://127.0.0.1:{port}/v1/generate", json=generate_body(4), timeout=120)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the server's handler takes it while cli.main runs

    caller = threading.Thread(target=call_then_stop, daemon=True)
    caller.start()
    status = cli.main(["serve", "--port", str(port), "--device", "cpu", *argv])
    caller.join(timeout=10)
    return status


def transformers_switches():
    from transformers.utils import logging as hf_logging

    return hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()


@contextlib.contextmanager
def transformers_talking():
    """transformers' defaults (warnings, progress bars), whatever earlier tests set; the warnings it
    logs collected in the list this yields."""
    from transformers.utils import logging as hf_logging

    before = transformers_switches()
    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        yield warnings
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        hf_logging.set_verbosity(before[0])
        (hf_logging.enable_progress_bar if before[1] else hf_logging.disable_progress_bar)()


def forget_warnings_once() -> None:
    """transformers logs each `warning_once` message once per process: earlier tests used them up."""
    logging.Logger.warning_once.cache_clear()


def test_quiet_serves_without_progress_bar_or_transformers_warning(noisy_checkpoint, capfd):
    with transformers_talking() as warnings:
        forget_warnings_once()
        with foveal.load(noisy_checkpoint, device="cpu") as model:  # what nothing keeps quiet prints
            model.generate(scene(0), "x", foveal.Regex("[ab]{4}"))
        _, err = capfd.readouterr()
        assert "Loading weights" in err
        said = " ".join(r.getMessage() for r in warnings)
        assert "LOAD REPORT" in said and "loss_type" not in said  # the load's warning; tracing reads no loss
        warnings.clear()
        forget_warnings_once()
        switches = transformers_switches()
        assert serve_one_call(["--model", str(noisy_checkpoint), "--quiet"]) == 0
        out, err = capfd.readouterr()
        assert "serving on" in out and "foveal: stopped" in out
        assert not warnings, [r.getMessage() for r in warnings]
        assert "Loading weights" not in err and "it/s" not in err, err
        assert transformers_switches() == switches  # put back when the server stopped, not left off


# ---- the real process --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_answers_every_call_in_flight_and_exits_0():
    """`foveal serve` as a process, six long calls in flight and a grace they cannot make: each is
    answered (a 503 in the error body), the process exits 0, and nothing in its log is a traceback."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "foveal",
            "serve",
            "--port",
            "0",
            "--device",
            "cpu",
            "--shutdown-grace",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = None
        for line in process.stdout:
            if "serving on" in line:
                url = line.split("serving on ", 1)[1].split()[0]
                break
        assert url, "foveal serve did not say where it serves"
        calls = Calls(url)
        for i in range(6):
            calls.post(f"generate{i}", "/v1/generate", generate_body(200))
        wait_for(lambda: in_flight(url) == 6, "six calls in flight")
        process.send_signal(signal.SIGTERM)
        calls.join()
        assert process.wait(timeout=60) == 0
        log = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
    answers = list(calls.results.values())
    assert all(status == 200 or shutting_down((status, body)) for status, body in answers), answers
    assert any(status == 503 for status, _ in answers)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert "foveal: stopped" in log
