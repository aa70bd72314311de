"""`foveal serve --replicas` without a Ray instance: the affinity key and the routing rule
(affinity.py), Ray Serve's router over them (router.py, with stand-in replicas), the merged
/metrics page (fleet_metrics.py), the bridge that runs a forwarded request through the app in a
replica (bridge.py, over the session's embedded model), and the command line's refusals before
Ray starts. The end-to-end tests on a local Ray instance are in test_replicas_ray.py (slow).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from foveal import cli
from foveal.server import create_app
from foveal.server.affinity import PINNED, affinity_key, home_or_any, rank
from foveal.server.bridge import REPLICA_HEADER, Forwarded, Head, relay
from foveal.server.fleet_metrics import merge
from tests.server.conftest import all_pages_free, data_url, scene


def _body(value: dict) -> bytes:
    return json.dumps(value).encode()


def test_the_same_image_has_one_key_whatever_the_route_or_question():
    image, other = data_url(scene(1)), data_url(scene(2))
    detect = affinity_key(_body({"image_url": image, "object": "circle"}))
    query = affinity_key(_body({"image_url": image, "question": "how many?"}))
    chat = affinity_key(
        _body(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi"},
                            {"type": "image_url", "image_url": {"url": image}},
                        ],
                    },
                ]
            }
        )
    )
    assert detect == query == chat and detect.startswith("image:")
    assert affinity_key(_body({"image_url": other, "object": "circle"})) != detect


def test_an_image_body_keys_without_being_parsed(monkeypatch):
    image = data_url(scene(3))
    parsed = affinity_key(_body({"object": "circle", "image_url": image}))

    def refuse(*args, **kwargs):
        raise AssertionError("an image body was parsed")

    monkeypatch.setattr(json, "loads", refuse)
    assert affinity_key(_body({"image_url": image, "object": "circle"})) == parsed
    # a quoted "data: inside some text is not a string's start: the image after it is the key
    quoted = _body({"prompt": 'say "data:x" twice', "image_url": image})
    assert b'\\"data:x' in quoted and affinity_key(quoted) == parsed
    monkeypatch.undo()
    escaped = json.dumps({"image_url": image}).replace("/", "\\/").encode()  # PHP's default
    assert affinity_key(escaped) is None  # no text either: least loaded, never a wrong home


def test_text_only_requests_key_on_their_prefix_and_the_rest_have_none():
    system = "You are a careful assistant. " * 20  # longer than the prefix
    one = affinity_key(
        _body({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "a"}]})
    )
    two = affinity_key(
        _body({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "b"}]})
    )
    assert one == two and one.startswith("prefix:")
    assert affinity_key(b"") is None
    assert affinity_key(b"not json") is None
    assert affinity_key(_body({"model": "foveal"})) is None


def test_rendezvous_ranking_ignores_order_and_moves_only_the_leavers_keys():
    replicas = ["a1", "b2", "c3", "d4"]
    keys = [f"image:{i}" for i in range(400)]
    assert all(rank(k, replicas) == rank(k, list(reversed(replicas))) for k in keys)
    homes = {k: rank(k, replicas)[0] for k in keys}
    assert len(set(homes.values())) == 4  # every replica is some image's home
    after = {k: rank(k, ["a1", "c3", "d4"])[0] for k in keys}
    assert all(after[k] == homes[k] for k in keys if homes[k] != "b2")


def test_an_overloaded_home_gives_way_to_the_least_loaded():
    key = "image:x"
    home = rank(key, ["a", "b"])[0]
    other = "b" if home == "a" else "a"
    assert home_or_any(key, {home: 3, other: 0}, imbalance=8) == home
    assert home_or_any(key, {home: 8, other: 0}, imbalance=8) is None
    assert home_or_any(key, {}, imbalance=8) is None


class _Cache:
    def __init__(self, loads: dict) -> None:
        self.loads = loads

    def get(self, replica_id) -> int | None:
        return self.loads.get(replica_id.unique_id)


def _router(loads: dict):
    pytest.importorskip("ray.serve")
    from foveal.server.router import AffinityRouter

    router = object.__new__(AffinityRouter)  # Serve builds it with its own plumbing; the rule needs none
    router.imbalance = 8
    router._replica_queue_len_cache = _Cache(loads)
    return router


def _pending(key: str | None):
    return SimpleNamespace(
        metadata=SimpleNamespace(session_id=key), routing_context=SimpleNamespace(should_backoff=False)
    )


def test_the_router_ranks_the_home_first_pins_probes_and_spreads_the_rest():
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("r1", "r2", "r3")]
    router = _router({"r1": 0, "r2": 0, "r3": 0})
    home = rank("image:k", ["r1", "r2", "r3"])[0]
    pending = _pending("image:k")
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert [[r.replica_id.unique_id for r in rank_] for rank_ in ranks] == [[home]]
    assert pending.routing_context.should_backoff  # a round nobody accepts sleeps, never spins
    pinned = asyncio.run(router.choose_replicas(replicas, _pending(PINNED + "r2")))
    assert [[r.replica_id.unique_id for r in rank_] for rank_ in pinned] == [["r2"]]
    assert asyncio.run(router.choose_replicas(replicas, _pending(None))) == [replicas]
    busy = _router({home: 20, **{u: 0 for u in ("r1", "r2", "r3") if u != home}})
    assert asyncio.run(busy.choose_replicas(replicas, _pending("image:k"))) == [replicas]


def test_metrics_of_all_replicas_merge_into_one_group_per_family():
    page = (
        "# HELP foveal_http_requests_total HTTP requests\n# TYPE foveal_http_requests_total counter\n"
        'foveal_http_requests_total{route="/v1/detect",status="200"} 3\n'
        "# HELP foveal_queue_depth depth\n# TYPE foveal_queue_depth gauge\nfoveal_queue_depth 1\n"
    )
    lines = merge([("r1", page), ("r2", page)])
    assert lines.count("# TYPE foveal_http_requests_total counter") == 1
    start = lines.index("# TYPE foveal_http_requests_total counter")
    assert lines[start + 1 : start + 3] == [
        'foveal_http_requests_total{replica="r1",route="/v1/detect",status="200"} 3',
        'foveal_http_requests_total{replica="r2",route="/v1/detect",status="200"} 3',
    ]
    assert 'foveal_queue_depth{replica="r2"} 1' in lines


async def _relayed(app, request: Forwarded) -> list:
    async with app.router.lifespan_context(app):
        return [piece async for piece in relay(app, request, "r7")]


def test_the_bridge_answers_a_call_in_one_piece_and_a_stream_in_chunks(model):
    app = create_app(model)
    body = _body({"image_url": data_url(scene(1)), "object": "circle"})
    headers = [(b"content-type", b"application/json")]
    pieces = asyncio.run(_relayed(app, Forwarded("POST", "/v1/detect", headers=headers, body=body)))
    assert len(pieces) == 1 and isinstance(pieces[0], Head) and pieces[0].status == 200 and not pieces[0].more
    assert (REPLICA_HEADER.encode(), b"r7") in pieces[0].headers
    assert "objects" in json.loads(pieces[0].body)
    stream = _body({"image_url": data_url(scene(1)), "stream": True})
    app = create_app(model)  # an app's events belong to the event loop it ran on
    pieces = asyncio.run(_relayed(app, Forwarded("POST", "/v1/caption", headers=headers, body=stream)))
    text = pieces[0].body + b"".join(pieces[1:])
    assert pieces[0].more and b'"completed":true' in text


def test_the_bridge_cancels_the_call_when_its_consumer_stops(model):
    app = create_app(model)
    stream = _body({"image_url": data_url(scene(3)), "stream": True, "length": "long"})
    request = Forwarded("POST", "/v1/caption", headers=[(b"content-type", b"application/json")], body=stream)

    async def first_then_stop() -> Head:
        async with app.router.lifespan_context(app):
            pieces = relay(app, request, "r7")
            head = await pieces.__anext__()
            await pieces.aclose()  # what Serve does when the ingress cancels the call
            return head

    assert asyncio.run(first_then_stop()).status == 200
    assert all_pages_free(model)


def test_replica_options_are_checked_before_ray_starts(capsys):
    pytest.importorskip("ray.serve")
    import ray

    for args, says in (
        (("--replicas", "0"), "--replicas 0 is not accepted"),
        (("--replicas", "2", "--max-replicas", "3"), "not both"),
        (("--min-replicas", "3", "--max-replicas", "2"), "above --max-replicas"),
        (("--replicas", "2", "--replica-cpus", "-1"), "--replica-cpus"),
        (("--replicas", "2", "--read-timeout", "5"), "Ray Serve's proxy reads the requests"),
    ):
        assert cli.main(["serve", "--port", "0", *args]) == 2
        assert says in capsys.readouterr().err
    assert cli.main(["serve", "--port", "0", "--read-timeout", "0"]) == 2  # one process checks it
    assert "read_timeout_s must be > 0" in capsys.readouterr().err
    started = time.monotonic()
    assert cli.main(["serve", "--port", "0", "--replicas", "2", "--ray-address", "127.0.0.1:1"]) == 2
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in capsys.readouterr().err
    assert time.monotonic() - started < 30  # ray.init alone would retry it for minutes
    assert not ray.is_initialized()
