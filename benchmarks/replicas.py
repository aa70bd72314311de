"""Image-affine routing against Ray Serve's default routing: cache hits and throughput over replicas.

    python -m benchmarks.replicas [--replicas 2] [--images 16] [--repeats 6] [--concurrency 8]
                                  [--replica-cpus 0.5] [--out out/benchmarks/replicas.json] [--quick]

The workload: --images distinct shapes scenes, each asked --repeats times (detect, query and
caption in turn), shuffled once with a fixed seed, sent by --concurrency loopback clients to one
`foveal serve --replicas` application (server/replicas.py) on a local Ray instance. It runs twice
on the same instance, with a fresh application each time (cold caches):
    affinity: the ingress names each request's image as its routing key (router.AffinityRouter);
    default:  Ray Serve's own routing (power of two choices on queue length), no key.
Reported per routing: requests per second (wall time of the whole workload), p50 latency, the
prefix cache's share of prompt tokens (KV pages reused: the image's tokens in this workload), the
image-feature cache's hit rate, and on how many replicas each image ended up (1.0: never twice).
The counts come from the application's own /metrics (every replica's, labelled). Every figure is
printed and written beside the CPU it was measured on (lscpu's model name and CPU count).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import time
from collections import defaultdict

import httpx

from benchmarks import write_json
from foveal.server.replicas import ReplicaArgs, application
from tests.server.conftest import data_url, scene

APP = "foveal_bench"
PORT = 8931
CALLS = (
    ("/v1/detect", {"object": "circle"}),
    ("/v1/query", {"question": "how many shapes?"}),
    ("/v1/caption", {}),
)


def cpu() -> str:
    """The CPU, as lscpu names it, with its count."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def workload(images: int, repeats: int) -> list[tuple[str, dict]]:
    urls = [data_url(scene(seed)) for seed in range(images)]
    requests = [
        (CALLS[r % len(CALLS)][0], {"image_url": u, **CALLS[r % len(CALLS)][1]})
        for u in urls
        for r in range(repeats)
    ]
    random.Random(0).shuffle(requests)
    return requests


async def drive(url: str, requests: list[tuple[str, dict]], concurrency: int) -> dict:
    """Send the workload; wall time, latencies, and which replica answered each image."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    latencies: list[float] = []
    homes: dict[str, set[str]] = defaultdict(set)
    failures = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            path, body = queue.get_nowait()
            started = time.perf_counter()
            response = await http.post(path, json=body)
            latencies.append(time.perf_counter() - started)
            failures += response.status_code != 200
            homes[body["image_url"]].add(response.headers.get("x-foveal-replica", "?"))

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"wall_s": wall, "latencies": latencies, "homes": homes, "failures": failures}


def counters(metrics: str) -> dict[str, float]:
    """The caches' counts summed over the replicas."""
    sums: dict[str, float] = defaultdict(float)
    for name, value in re.findall(
        r"^(foveal_(?:prompt_tokens|prefix_cache_tokens|image_cache_\w+)_total)\{[^}]*\} (\S+)$",
        metrics,
        re.M,
    ):
        sums[name] += float(value)
    return sums


def scrape(url: str, replicas: int) -> dict[str, float]:
    """The summed counts, once every replica answered the scrape (one too busy is left out of a page)."""
    for _ in range(20):
        page = httpx.get(f"{url}/metrics", timeout=30).text
        if len(set(re.findall(r'^foveal_prompt_tokens_total\{replica="([^"]+)"', page, re.M))) == replicas:
            return counters(page)
        time.sleep(0.5)
    raise RuntimeError(f"/metrics did not list {replicas} replicas")


def run_once(serve, routing: str, args: argparse.Namespace, requests: list) -> dict:
    from foveal.server.replica_run import wait_ready

    spec = ReplicaArgs(replicas=args.replicas, replica_cpus=args.replica_cpus, device="cpu", routing=routing)
    serve.run(application(spec), name=APP, route_prefix="/")
    if not wait_ready(serve, APP, spec.initial_replicas, 120):
        raise RuntimeError(f"{spec.initial_replicas} replicas did not answer /health within 120 s")
    url = f"http://127.0.0.1:{PORT}"
    warm = [(p, {**b, "image_url": data_url(scene(10_000 + i))}) for i, (p, b) in enumerate(requests[:8])]
    asyncio.run(drive(url, warm, args.concurrency))  # traces and grammars, on images the workload never sends
    before = scrape(url, args.replicas)
    measured = asyncio.run(drive(url, requests, args.concurrency))
    after = scrape(url, args.replicas)
    serve.delete(APP)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    hits, misses = (
        delta.get("foveal_image_cache_hits_total", 0),
        delta.get("foveal_image_cache_misses_total", 0),
    )
    prompt = delta.get("foveal_prompt_tokens_total", 0)
    return {
        "routing": routing,
        "requests": len(requests),
        "failures": measured["failures"],
        "requests_per_s": len(requests) / measured["wall_s"],
        "p50_ms": 1e3 * statistics.median(measured["latencies"]),
        "prefix_hit_rate": delta.get("foveal_prefix_cache_tokens_total", 0) / prompt if prompt else 0.0,
        "image_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "replicas_per_image": statistics.mean(len(r) for r in measured["homes"].values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2, help="each routing this many times, interleaved")
    parser.add_argument("--out", default="out/benchmarks/replicas.json")
    parser.add_argument("--quick", action="store_true", help="8 images x 3 repeats, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.repeats, args.rounds = 8, 3, 1

    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    requests = workload(args.images, args.repeats)
    rows = []
    try:
        for _ in range(args.rounds):  # interleaved: a slower stretch of the machine hits both alike
            rows += [run_once(serve, routing, args, requests) for routing in ("affinity", "default")]
    finally:
        serve.shutdown()
        ray.shutdown()
    machine = cpu()
    for row in rows:
        row["cpu"] = machine
    report = {
        "cpu": machine,
        "replicas": args.replicas,
        "replica_cpus": args.replica_cpus,
        "images": args.images,
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "rows": rows,
    }
    print(
        f"{args.replicas} replicas x {args.replica_cpus:g} CPU, {args.images} images x {args.repeats} calls, "
        f"{args.concurrency} clients; CPU: {machine}"
    )
    print(
        f"{'routing':10}{'req/s':>8}{'p50 ms':>9}{'prefix hit':>12}{'image hit':>11}{'replicas/img':>14}{'fail':>6}"
    )
    for row in rows:
        print(
            f"{row['routing']:10}{row['requests_per_s']:>8.1f}{row['p50_ms']:>9.0f}{row['prefix_hit_rate']:>12.1%}"
            f"{row['image_cache_hit_rate']:>11.1%}{row['replicas_per_image']:>14.2f}{row['failures']:>6}"
        )
    print(f"wrote {write_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
