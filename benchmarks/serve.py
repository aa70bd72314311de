"""Load and fault test of `foveal serve` on loopback (issue 16), and its cost next to the in-process SDK.

64 concurrent clients (asyncio, one httpx connection pool) send a fixed, seeded mix of requests to
a real `foveal serve --port 0` process (the embedded model): Moondream detect / point / caption /
query, streamed captions and answers, OpenAI chat completions (plain and streamed); a fraction of
the streams disconnect after their first chunk. Reported: p50 / p99 latency of the completed
requests, throughput, responses by status, and afterwards, from the server's /metrics, that the
engine holds nothing (queue depth 0) and every KV page is free. Then the same requests run through
the in-process SDK (`foveal.load()`, the async twins, 64 concurrent tasks; a disconnect is a stream
closed after its first chunk): HTTP throughput / SDK throughput (target >= 0.9).

    python -m benchmarks.serve [--clients 64] [--requests 256] [--disconnect 0.15] [--out out/benchmarks/serve.json]

Loopback only and bounded: a fixed request count, a per-request timeout, the server stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from foveal.vision import scenes

KINDS = (  # (kind, weight)
    ("detect", 0.25),
    ("point", 0.15),
    ("caption", 0.10),
    ("caption_stream", 0.15),
    ("query", 0.10),
    ("query_stream", 0.10),
    ("chat", 0.08),
    ("chat_stream", 0.07),
)
STREAMS = {"caption_stream", "query_stream", "chat_stream"}
QUESTIONS = {"query": "how many shapes are there?", "chat": "what colour is the circle?"}
TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Job:
    kind: str
    image: bytes  # PNG
    phrase: str
    disconnect: bool


@dataclass(slots=True)
class Outcome:
    kind: str
    status: int  # HTTP status; 0 for a client-side error; 499 for our own disconnects
    seconds: float


def workload(n: int, disconnect: float, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS, strict=True)
    jobs = []
    for i in range(n):
        scene = scenes.generate_scene(seed * 100_000 + i, 160)
        buffer = io.BytesIO()
        scenes.render(scene).save(buffer, "PNG")
        kind = rng.choices(kinds, weights)[0]
        jobs.append(
            Job(
                kind,
                buffer.getvalue(),
                scene.objects[0].phrase(),
                kind in STREAMS and rng.random() < disconnect,
            )
        )
    return jobs


# ---- HTTP ---------------------------------------------------------------------------------------------------


def request_of(job: Job) -> tuple[str, dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(job.image).decode()
    base = job.kind.removesuffix("_stream")
    stream = job.kind in STREAMS
    if base in ("detect", "point"):
        return f"/v1/{base}", {"image_url": url, "object": job.phrase}
    if base == "caption":
        return "/v1/caption", {"image_url": url, "length": "normal", "stream": stream}
    if base == "query":
        return "/v1/query", {"image_url": url, "question": QUESTIONS["query"], "stream": stream}
    parts = [
        {"type": "text", "text": QUESTIONS["chat"]},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return "/v1/chat/completions", {
        "model": "foveal",
        "messages": [{"role": "user", "content": parts}],
        "stream": stream,
    }


async def http_one(client: httpx.AsyncClient, job: Job) -> Outcome:
    path, body = request_of(job)
    started = time.perf_counter()
    try:
        if job.kind not in STREAMS:
            response = await client.post(path, json=body)
            return Outcome(job.kind, response.status_code, time.perf_counter() - started)
        async with client.stream("POST", path, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and job.disconnect:
                    return Outcome(job.kind, 499, time.perf_counter() - started)  # leave mid-stream
            return Outcome(job.kind, response.status_code, time.perf_counter() - started)
    except httpx.HTTPError:
        return Outcome(job.kind, 0, time.perf_counter() - started)


async def run_http(url: str, jobs: list[Job], clients: int) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as client:
        return await run_pool(jobs, clients, lambda job: http_one(client, job))


# ---- in-process SDK ----------------------------------------------------------------------------------------


async def sdk_one(model: Any, job: Job) -> Outcome:
    """The same request through the async twins (chat is answered by query, as the server does)."""
    base = job.kind.removesuffix("_stream")
    stream = job.kind in STREAMS
    started = time.perf_counter()
    if base in ("detect", "point"):
        await getattr(model, f"a{base}")(job.image, job.phrase)
    elif base == "caption":
        result = await model.acaption(job.image, "normal", stream)
        left = stream and await drain(result["caption"], job.disconnect)
    else:
        result = await model.aquery(job.image, QUESTIONS[base], stream=stream or base == "chat")
        left = (stream or base == "chat") and await drain(result["answer"], job.disconnect)
    status = 499 if base not in ("detect", "point") and left else 200
    return Outcome(job.kind, status, time.perf_counter() - started)


async def drain(chunks: Any, disconnect: bool) -> bool:
    """Read a stream to its end, or close it after the first chunk; True when it was left early."""
    async for _ in chunks:
        if disconnect:
            await chunks.aclose()
            return True
    return False


async def run_pool(jobs: list[Job], clients: int, one: Any) -> tuple[list[Outcome], float]:
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while not queue.empty():
            outcomes.append(await one(queue.get_nowait()))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes, time.perf_counter() - started


# ---- the server process -------------------------------------------------------------------------------------


def start_server() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "foveal", "serve", "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "FOVEAL_API_KEY"},
    )
    for line in process.stdout:
        if "serving on" in line:
            url = line.split("serving on ", 1)[1].split()[0]
            break
    else:
        raise RuntimeError("foveal serve did not start")
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the model did not load within 120 s")
        time.sleep(0.1)
    return process, url


def scrape(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return values


def wait_settled(url: str, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing is queued and every page is back (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(url)
        free = values.get("foveal_engine_kv_pages_free") == values.get("foveal_engine_kv_pages_total")
        if (values.get("foveal_queue_depth") == 0 and free) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


# ---- report -------------------------------------------------------------------------------------------------


def summary(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    done = sorted(o.seconds for o in outcomes if o.status == 200)

    def p(q: float) -> float:
        return done[min(len(done) - 1, int(q * len(done)))] if done else float("nan")

    return {
        "requests": len(outcomes),
        "completed": len(done),
        "wall_s": round(wall_s, 2),
        "throughput_rps": round(len(outcomes) / wall_s, 2),
        "p50_ms": round(p(0.50) * 1000, 1),
        "p99_ms": round(p(0.99) * 1000, 1),
        "mean_ms": round(statistics.fmean(done) * 1000, 1) if done else None,
        "by_status": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--disconnect", type=float, default=0.15, help="fraction of streams that leave early")
    parser.add_argument("--out", type=Path, default=Path("out/benchmarks/serve.json"))
    args = parser.parse_args()
    jobs = workload(args.requests, args.disconnect)
    warm = workload(16, 0.0, seed=1)

    process, url = start_server()
    try:
        asyncio.run(run_http(url, warm, 16))  # traces and caches warm, as the SDK's below
        http_outcomes, http_wall = asyncio.run(run_http(url, jobs, args.clients))
        after = wait_settled(url)
    finally:
        process.send_signal(signal.SIGTERM)
        exit_status = process.wait(timeout=60)

    import foveal

    model = foveal.load(device="cpu")
    try:
        asyncio.run(run_pool(warm, 16, lambda job: sdk_one(model, job)))
        sdk_outcomes, sdk_wall = asyncio.run(run_pool(jobs, args.clients, lambda job: sdk_one(model, job)))
    finally:
        model.close()

    http, sdk = summary(http_outcomes, http_wall), summary(sdk_outcomes, sdk_wall)
    report = {
        "clients": args.clients,
        "requests": args.requests,
        "disconnecting_streams": sum(j.disconnect for j in jobs),
        "mix": dict(Counter(j.kind for j in jobs)),
        "http": http,
        "sdk": sdk,
        "http_over_sdk_throughput": round(http["throughput_rps"] / sdk["throughput_rps"], 3),
        "after": {
            "queue_depth": after.get("foveal_queue_depth"),
            "kv_pages_free": after.get("foveal_engine_kv_pages_free"),
            "kv_pages_total": after.get("foveal_engine_kv_pages_total"),
            "client_disconnects_counted": after.get("foveal_client_disconnects_total"),
            "device_idle_fraction": after.get("foveal_engine_device_idle_fraction"),
            "server_exit_status": exit_status,
        },
    }
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


def print_table(report: dict[str, Any]) -> None:
    http, sdk = report["http"], report["sdk"]
    print(
        f"{report['requests']} requests, {report['clients']} clients, {report['disconnecting_streams']} streams disconnect"
    )
    print(f"{'':10} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9} {'wall s':>8}  statuses")
    for name, row in (("http", http), ("sdk", sdk)):
        print(
            f"{name:10} {row['throughput_rps']:>8} {row['p50_ms']:>9} {row['p99_ms']:>9} {row['wall_s']:>8}  {row['by_status']}"
        )
    ratio = report["http_over_sdk_throughput"]
    print(f"HTTP / SDK throughput: {ratio} (target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    after = report["after"]
    print(
        f"after: queue depth {after['queue_depth']}, KV pages free {after['kv_pages_free']}/{after['kv_pages_total']}, "
        f"server exit status {after['server_exit_status']}"
    )


if __name__ == "__main__":
    main()
