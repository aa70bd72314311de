"""Bad input gets a clear 4xx JSON error and nothing breaks; disconnects cancel their requests."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import httpx
import pytest
from PIL import Image

from foveal.server import ServerConfig
from tests.server.conftest import all_pages_free, data_url, scene


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", **{"timeout": 60, **kwargs})


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["message"] and body["type"]
    return body["message"]


def test_malformed_json_and_missing_fields(server):
    assert "not valid JSON" in error_of(
        post(server, "/v1/detect", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
    message = error_of(post(server, "/v1/detect", json={"image_url": data_url(scene(0))}), 422)
    assert "object: required field is missing" in message
    assert "unknown field" in error_of(
        post(server, "/v1/point", json={"image_url": "x", "object": "o", "colour": 1}), 422
    )


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
        post(url, "/v1/detect", json={"image_url": big, "object": "o"}), 413
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
    assert "uniqueItems" in error_of(post(server, "/v1/generate", json=unenforceable), 422)
    both = {"prompt": "x", "regex": "a", "grammar": "start: 'a'"}
    assert "at most one output type" in error_of(post(server, "/v1/generate", json=both), 400)
    cut = {"prompt": "x", "image_url": image, "regex": "[ab]{50}", "settings": {"max_tokens": 60}}
    assert post(server, "/v1/generate", json=cut).status_code in (200, 422)


def test_disconnect_mid_request_cancels_it(random_server, random_model):
    """A long generate (480 tokens, ~1 s with the lean forward here, more on a loaded machine) whose
    client leaves after 0.25 s ends CANCELLED at once: far fewer tokens than asked are decoded."""
    random_model.engine.wait_idle(10)
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
    assert "--max-queue" in error_of(refused, 429) and refused.headers["retry-after"] == "1"
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
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("foveal_queue_depth "):
            return float(line.split()[1])
    return 0.0
