"""`AffinityRouter`: Ray Serve's request router for foveal's replicas, with image-affine routing.

The ingress (replicas.py) names each forwarded request's affinity key (affinity.py) as the
handle call's `session_id`; Serve hands it to this router in the pending request's metadata. The
router answers Serve's one question, "which replicas, in order of preference", and Serve does the
rest: it sends the request to the least loaded replica of the first rank that accepts (a queue not
full), retrying the ranks with a backoff while none does, and drops a replica whose actor died from
the candidates at once (`on_replica_actor_died`), so the next choice sees a new home.

    key "image:..." / "prefix:..."  ->  [[home]]        (or [all] when the home is overloaded)
    key "replica:ID"                ->  [[ID]]          (/health and /metrics ask each replica)
    no key                          ->  [all]           (the least loaded: Serve picks the shortest queue)

The home is the only rank: with a second rank of all replicas, a home whose queue-length probe
missed Serve's deadline (a replica busy on a loaded machine) would lose the request to another
replica, and its caches the hit; overload is this router's decision (`imbalance`), not a probe's.
The loads are Serve's own cache of each replica's requests in flight (updated as requests are sent
and finish, and by the replicas' answers to Serve's probes); a replica missing from it counts as
idle. Every rank list sets `should_backoff`, so a round where no replica accepts sleeps before the
next instead of spinning on the event loop.

Configured with `request_router_config={"request_router_class": "foveal.server.router:AffinityRouter",
"request_router_kwargs": {"imbalance": N}}`.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from foveal.server.affinity import PINNED, home_or_any

DEFAULT_IMBALANCE = 8  # requests in flight: the engine batches them, so a few more cost little


class AffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs: object) -> None:
        if not isinstance(imbalance, int) or imbalance < 1:
            raise ValueError(f"imbalance must be an int >= 1 (requests in flight), got {imbalance!r}")
        self.imbalance = imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
            key = pending_request.metadata.session_id or None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if key is None or not key.startswith(("image:", "prefix:", PINNED)):
            return [candidate_replicas]
        if key.startswith(PINNED):
            pinned = by_id.get(key[len(PINNED) :])
            return [[pinned]] if pinned is not None else [candidate_replicas]
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        home = home_or_any(key, loads, getattr(self, "imbalance", DEFAULT_IMBALANCE))
        return [candidate_replicas] if home is None else [[by_id[home]]]
