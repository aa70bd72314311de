"""Operations: /health before and after loading, /metrics in Prometheus text, and `foveal serve` as a
process: prints its URL, serves, and exits 0 on SIGTERM and on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from foveal.server import create_app
from foveal.server.background import BackgroundServer
from tests.server.conftest import data_url, scene


def test_health_is_503_until_the_model_is_loaded(model):
    release = threading.Event()

    def loader():
        release.wait(30)
        return model

    app = create_app(loader=loader)
    with BackgroundServer(app) as url:
        loading = httpx.get(f"{url}/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        assert (
            httpx.post(f"{url}/v1/point", json={"image_url": data_url(scene(0)), "object": "o"}).status_code
            == 503
        )
        release.set()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": "foveal"}
        app.state.foveal.model = None  # the session's model is shared: do not let this app close it


def test_metrics_count_requests_tokens_and_engine(server):
    httpx.post(f"{server}/v1/detect", json={"image_url": data_url(scene(0)), "object": "circle"}, timeout=60)
    httpx.post(f"{server}/v1/detect", json={"image_url": "http://x", "object": "circle"}, timeout=60)
    text = httpx.get(f"{server}/metrics").text
    assert 'foveal_http_requests_total{route="/v1/detect",status="200"}' in text
    assert 'foveal_http_requests_total{route="/v1/detect",status="400"}' in text
    assert 'foveal_http_request_duration_seconds_count{route="/v1/detect"}' in text
    for name in (
        "foveal_queue_depth 0",
        "foveal_engine_tokens_total",
        "foveal_engine_step_forward_ms",
        "foveal_engine_device_idle_fraction",
        "foveal_engine_kv_pages_free",
        "foveal_engine_kv_pages_total",
    ):
        assert name in text
    assert httpx.get(f"{server}/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_foveal_serve_prints_its_url_and_stops_cleanly(stop):
    env = {**os.environ, "FOVEAL_API_KEY": "k"}
    process = subprocess.Popen(
        [sys.executable, "-m", "foveal", "serve", "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = None
        for line in process.stdout:
            if "serving on" in line:
                url = line.split("serving on ", 1)[1].split()[0]
                break
        assert url and url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load in 60 s"
            time.sleep(0.1)
        body = {"image_url": data_url(scene(0)), "object": "shape"}
        assert httpx.post(f"{url}/v1/point", json=body, timeout=60).status_code == 401
        ok = httpx.post(f"{url}/v1/point", json=body, headers={"X-Moondream-Auth": "k"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["points"]
        process.send_signal(stop)
        assert process.wait(timeout=30) == 0
        assert "foveal: stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
