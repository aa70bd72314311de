"""Bad input gets a clear 4xx JSON error and nothing breaks; every error, FastAPI's own and an
unexpected exception included, has the one body of errors.py, in HTTP terms; disconnects cancel
their requests and are counted."""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import socket
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

import foveal
from foveal.server import ServerConfig, create_app
from foveal.server.errors import http_message
from tests.server.conftest import all_pages_free, data_url, scene

TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", **{"timeout": 60, **kwargs})


def error_of(response: httpx.Response, status: int, code: str | None = None) -> str:
    """The message of an error response, after checking its status and the one body shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["message"] and error["type"] == TYPES.get(status, "invalid_request_error"), error
    assert error["code"] == code if code else error["code"], error
    return error["message"]


class Failing:
    """The session's model with one skill replaced by one that raises `error` (no other change)."""

    def __init__(self, model: foveal.Model, skill: str, error: Exception) -> None:
        self._model, self._skill, self._error = model, skill, error

    def __getattr__(self, name: str):
        if name != self._skill:
            return getattr(self._model, name)

        async def fail(*args, **kwargs):
            raise self._error

        return fail


def test_malformed_json_and_missing_fields(server):
    assert "not valid JSON" in error_of(
        post(server, "/v1/detect", content=b"{nope", headers={"content-type": "application/json"}),
        400,
        "invalid_json",
    )
    message = error_of(
        post(server, "/v1/detect", json={"image_url": data_url(scene(0))}), 422, "invalid_body"
    )
    assert "object: required field is missing" in message
    assert "unknown field" in error_of(
        post(server, "/v1/point", json={"image_url": "x", "object": "o", "colour": 1}), 422
    )


def test_fastapis_own_errors_have_the_one_body(server):
    """No route, a wrong method, a body FastAPI cannot decode: its default is `{"detail": ...}`."""
    assert "/docs" in error_of(httpx.get(f"{server}/nope"), 404, "not_found")
    assert "no route POST /v1/nope" in error_of(post(server, "/v1/nope", json={}), 404, "not_found")
    wrong = httpx.get(f"{server}/v1/chat/completions")
    assert "use POST" in error_of(wrong, 405, "method_not_allowed") and wrong.headers["allow"] == "POST"
    assert "use GET" in error_of(post(server, "/v1/models"), 405, "method_not_allowed")
    json_headers = {"content-type": "application/json"}
    for path in ("/v1/chat/completions", "/v1/generate", "/v1/caption"):
        assert "not valid JSON" in error_of(
            post(server, path, content=b"\xff\xfe", headers=json_headers), 400, "invalid_json"
        )
        assert "must be a JSON object" in error_of(
            post(server, path, content=b"[1]", headers=json_headers), 422, "invalid_body"
        )


def test_statuses_have_openais_types_and_codes(serve):
    url = serve(ServerConfig(api_key="sesame", max_body_bytes=1000))
    error_of(post(url, "/v1/models"), 401, "invalid_api_key")
    keyed = {"Authorization": "Bearer sesame"}
    error_of(post(url, "/v1/detect", content=b"x" * 2000, headers=keyed), 413, "request_too_large")
    error_of(post(url, "/v1/detect", json={}, headers=keyed), 422, "invalid_body")


def test_an_unexpected_exception_is_a_500_logged_once(model, caplog):
    secret = RuntimeError("KeyError at /home/build/foveal/sdk/model.py:123 in _secret_helper")
    app = create_app(Failing(model, "adetect", secret))
    body = {"image_url": data_url(scene(0)), "object": "circle"}
    with caplog.at_level(logging.INFO), TestClient(app) as client:  # a server error would raise here
        reply = client.post("/v1/detect", json=body)
        message = error_of(reply, 500, "internal_error")
        metrics = client.get("/metrics").text
    assert "secret" not in reply.text and "/home/" not in reply.text and "Traceback" not in reply.text
    assert "logged on the server" in message
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and logged[0].exc_info[1] is secret
    assert 'foveal_http_requests_total{route="/v1/detect",status="500"} 1' in metrics


def test_sdk_advice_reaches_http_clients_in_http_terms(server):
    """The SDK says "pass image=..."; an HTTP client sends an image_url."""
    for path, body in (
        ("/v1/query", {"question": "how many?"}),
        ("/v1/generate", {"prompt": "how many?", "regex": "[0-9]"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "how many?"}]}),
    ):
        message = error_of(post(server, path, json=body), 400)
        assert "needs an image" in message and "image_url" in message and "image=" not in message
    empty = {"image_url": data_url(scene(0)), "object": ""}
    assert "object is empty; send some text" in error_of(post(server, "/v1/detect", json=empty), 400)


@contextlib.contextmanager
def _failed_load():
    """A client of an app whose model load failed (device="cuda" where torch sees none), once it has."""
    app = create_app(loader=lambda: foveal.load(device="cuda"))
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        yield client


@pytest.mark.skipif(torch.cuda.is_available(), reason="the load fails only where torch sees no CUDA device")
def test_a_load_error_names_the_servers_flag_not_the_sdks_argument():
    with _failed_load() as client:
        body = {"image_url": data_url(scene(0)), "object": "o"}
        message = error_of(client.post("/v1/point", json=body), 503, "model_not_ready")
    assert "--device cpu" in message and "device='cpu'" not in message


# llguidance's refusal of a grammar with too many symbols (compiled on CPU, release build, trimmed):
# the panic message, then a backtrace with the build paths of the machine that built the wheel.
LLGUIDANCE_PANIC = """invalid grammar: panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10
<backtrace>
   0: <unknown>
   1: <unknown>
  16: type_call
             at /tmp/python-build.20260509073455.222/Python-3.11.7/Objects/typeobject.c:1091:11
  17: _PyObject_MakeTpCall
             at /tmp/python-build.20260509073455.222/Python-3.11.7/Objects/call.c:214:18
  35: _start

</backtrace>
fix the grammar (llguidance dialect) and compile again"""
# Rust's own panic report, as a debug build with RUST_BACKTRACE=1 prints it.
RUST_PANIC = """thread '<unnamed>' panicked at /root/.cargo/registry/src/index.crates.io-6f17d22bba15001f/derivre-0.3.1/src/ast.rs:412:9:
index out of bounds: the len is 3 but the index is 7
stack backtrace:
   0: rust_begin_unwind
             at /rustc/90b35a6239c3d8bdabc530a6a0816f7ff89a0aaf/library/std/src/panicking.rs:652:5
   1: core::panicking::panic_fmt
             at /rustc/90b35a6239c3d8bdabc530a6a0816f7ff89a0aaf/library/core/src/panicking.rs:72:14
note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace."""


@pytest.mark.parametrize(
    "native, first",
    [
        (LLGUIDANCE_PANIC, "invalid grammar: panic: assertion failed: grammar.symbols.len() < u16::MAX"),
        (RUST_PANIC, "index out of bounds: the len is 3 but the index is 7"),
        ("thread 'main' panicked at 'capacity overflow', src/liballoc/raw_vec.rs:750:5", "capacity overflow"),
    ],
)
def test_native_backtraces_are_cut_to_their_first_meaningful_line(native, first):
    message = http_message(native)
    assert message.startswith(first) and "\n" not in message
    for native_text in ("backtrace", "/rustc/", ".cargo", "python-build", "<unknown>", "panicked at"):
        assert native_text not in message
    assert "simplify the request and send it again" in message


def test_native_text_in_any_sdk_error_reaches_the_client_as_one_line(model):
    """Whatever exception carries native text (the grammar layer cleans its own; the engine's
    failures quote the runner's), the body gets its first line."""
    app = create_app(Failing(model, "agenerate", ValueError(LLGUIDANCE_PANIC)))
    with TestClient(app) as client:
        reply = client.post("/v1/generate", json={"prompt": "x", "grammar": "start: 'a'"})
    message = error_of(reply, 400, "invalid_value")
    assert message.startswith("invalid grammar: panic: assertion failed") and "backtrace" not in message
    assert "\n" not in message


def test_a_grammar_of_70000_literals_is_a_422_in_http_terms(server):
    """It panicked llguidance (at most 65525 symbols), whose backtrace reached the body; the
    grammar layer now refuses it on its compile budget, whose advice is Python's."""
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(70_000))
    reply = post(server, "/v1/generate", json={"prompt": "x", "grammar": grammar}, timeout=300)
    message = error_of(reply, 422, "unsupported_schema")
    assert "\n" not in message and "backtrace" not in message and "/tmp/" not in message
    assert "grammars." not in message and "compile again" not in message


def test_unknown_settings_and_bad_values(server, model):
    image = data_url(scene(0))
    assert "did you mean 'max_tokens'" in error_of(
        post(
            server, "/v1/detect", json={"image_url": image, "object": "circle", "settings": {"max_token": 3}}
        ),
        400,
    )
    assert "length" in error_of(post(server, "/v1/caption", json={"image_url": image, "length": "huge"}), 400)
    assert all_pages_free(model)


def test_images_that_cannot_be_used(server):
    body = {"object": "circle"}
    assert "remote URLs are not fetched" in error_of(
        post(server, "/v1/detect", json={**body, "image_url": "http://127.0.0.1/a.png"}), 400
    )
    assert "base64 data URL" in error_of(
        post(server, "/v1/detect", json={**body, "image_url": "file:///etc/passwd"}), 400
    )
    assert "base64 payload is invalid" in error_of(
        post(server, "/v1/detect", json={**body, "image_url": "data:image/png;base64,@@@"}), 400
    )
    not_an_image = "data:image/png;base64," + base64.b64encode(b"hello world").decode()
    assert error_of(post(server, "/v1/detect", json={**body, "image_url": not_an_image}), 400)
    # a decompression bomb: a tiny PNG whose header claims 20000 x 20000 pixels
    buffer = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buffer, "PNG")
    bomb = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert len(bomb) < 200_000
    assert "pixels" in error_of(post(server, "/v1/detect", json={**body, "image_url": bomb}), 400)


def test_body_over_the_limit_is_413(serve):
    url = serve(ServerConfig(max_body_bytes=10_000))
    big = data_url(Image.effect_noise((128, 128), 64).convert("RGB"))
    assert len(big) > 10_000
    assert "limit of 10000 bytes" in error_of(
        post(url, "/v1/detect", json={"image_url": big, "object": "o"}), 413, "request_too_large"
    )
    chunked = (part for part in (b'{"image_url": "', big.encode(), b'", "object": "o"}'))  # no Content-Length
    assert (
        post(url, "/v1/detect", content=chunked, headers={"content-type": "application/json"}).status_code
        == 413
    )


def test_generate_with_schema_regex_and_grammar(server):
    image = data_url(scene(1))
    body = {"prompt": "how many?", "image_url": image, "regex": "[0-9]"}
    reply = post(server, "/v1/generate", json=body).json()
    assert reply["text"] == reply["output"] and reply["text"].isdigit()
    body = {
        "prompt": "how many?",
        "image_url": image,
        "json_schema": {"type": "integer", "minimum": 0, "maximum": 9},
    }
    reply = post(server, "/v1/generate", json=body).json()
    assert isinstance(reply["output"], int)
    body = {
        "prompt": "sum",
        "image_url": image,
        "grammar": 'start: D "+" D\nD: /[0-9]/',
        "settings": {"max_tokens": 8},
    }
    reply = post(server, "/v1/generate", json=body).json()
    assert reply["output"][1] == "+"
    unenforceable = {"prompt": "x", "image_url": image, "json_schema": {"type": "array", "uniqueItems": True}}
    assert "uniqueItems" in error_of(
        post(server, "/v1/generate", json=unenforceable), 422, "unsupported_schema"
    )
    both = {"prompt": "x", "regex": "a", "grammar": "start: 'a'"}
    assert "at most one output type" in error_of(post(server, "/v1/generate", json=both), 400)
    cut = {"prompt": "x", "image_url": image, "regex": "[ab]{50}", "settings": {"max_tokens": 60}}
    assert post(server, "/v1/generate", json=cut).status_code in (200, 422)


def test_disconnect_mid_request_cancels_it(random_server, random_model):
    """A long generate (480 tokens, ~1 s with the lean forward here, more on a loaded machine) whose
    client leaves after 0.25 s ends CANCELLED at once: far fewer tokens than asked are decoded. It
    is counted as one disconnect."""
    random_model.engine.wait_idle(10)
    disconnects = _metric(random_server, "foveal_client_disconnects_total")
    body = {
        "prompt": "x",
        "image_url": data_url(scene(0)),
        "regex": "[ab]{480}",
        "settings": {"max_tokens": 490},
    }
    before = random_model.engine.stats()["tokens"]
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post(random_server, "/v1/generate", json=body, timeout=httpx.Timeout(60, read=0.25))
    assert all_pages_free(random_model, timeout=5)
    assert time.monotonic() - started < 6
    assert random_model.engine.stats()["tokens"] - before < 400
    assert _counted(random_server, "foveal_client_disconnects_total", disconnects + 1)


def test_a_dropped_stream_counts_as_a_disconnect(random_server, random_model):
    random_model.engine.wait_idle(10)
    disconnects = _metric(random_server, "foveal_client_disconnects_total")
    closed = 'foveal_http_requests_total{route="/v1/caption",status="499"}'
    dropped = _metric(random_server, closed)
    body = {"image_url": data_url(scene(0)), "stream": True, "settings": {"max_tokens": 400}}
    with httpx.stream("POST", f"{random_server}/v1/caption", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    assert _counted(random_server, "foveal_client_disconnects_total", disconnects + 1)
    assert _metric(random_server, closed) == dropped + 1
    assert all_pages_free(random_model, timeout=5)


def test_disconnect_mid_stream_cancels_it(random_server, random_model):
    random_model.engine.wait_idle(10)
    body = {"image_url": data_url(scene(0)), "stream": True, "settings": {"max_tokens": 400}}
    before = random_model.engine.stats()["tokens"]
    with httpx.stream("POST", f"{random_server}/v1/caption", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk read, then the connection closes
    assert all_pages_free(random_model, timeout=5)
    assert random_model.engine.stats()["tokens"] - before < 300


def test_queue_full_is_429_with_retry_after(random_server, random_model):
    """random_server admits 2 calls; a third one at the same time is refused at once."""
    body = {
        "prompt": "x",
        "image_url": data_url(scene(0)),
        "regex": "[ab]{200}",
        "settings": {"max_tokens": 220},
    }
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(post(random_server, "/v1/generate", json=body).status_code)
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while _queue_depth(random_server) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    refused = post(random_server, "/v1/generate", json=body)
    assert "--max-queue" in error_of(refused, 429, "queue_full") and refused.headers["retry-after"] == "1"
    for thread in threads:
        thread.join()
    assert results == [200, 200]
    assert all_pages_free(random_model)


def test_a_raw_socket_that_closes_early_breaks_nothing(server, model):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            b"POST /v1/detect HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
    assert (
        post(server, "/v1/point", json={"image_url": data_url(scene(0)), "object": "shape"}).status_code
        == 200
    )
    assert all_pages_free(model)


def _queue_depth(url: str) -> float:
    return _metric(url, "foveal_queue_depth")


def _metric(url: str, name: str) -> float:
    """A metric's value (with its labels in `name`, as /metrics writes them); 0 before it exists."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _counted(url: str, name: str, expected: float, timeout: float = 10.0) -> bool:
    """Whether the metric reaches `expected` (the server counts a request once it has ended) and
    stays there (no second count)."""
    deadline = time.monotonic() + timeout
    while _metric(url, name) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    return _metric(url, name) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the load fails only where torch sees no CUDA device")
def test_health_answers_the_error_body_in_http_terms_while_not_ready():
    with _failed_load() as client:
        response = client.get("/health")
    body = response.json()
    assert response.status_code == 503 and body["status"] == "failed"
    assert (
        set(body["error"]) == {"message", "type", "param", "code"}
        and body["error"]["code"] == "model_load_failed"
    )
    assert "--device cpu" in body["error"]["message"] and "device='cpu'" not in body["error"]["message"]
