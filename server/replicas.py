"""foveal's server as a Ray Serve application: N replicas of the `foveal serve` app behind one
ingress, with image-affine routing. What `foveal serve --replicas` runs (replica_run.py), and what
`serve run foveal.server.replicas:build_app` and a `serve deploy` config file name.

    HTTP -> Ray Serve's proxy -> FovealIngress (1 replica: reads the body, names its affinity key)
                               -> FovealReplica (N replicas, one model each: the app of app.py)

Why an ingress of our own: Serve's proxy routes before it reads a body, and the image is in the
body. The ingress reads it (Gate's limits first), computes the key (affinity.py), and forwards the
whole request through a deployment handle whose router (router.py) sends the key to its home
replica. The replica runs the request through create_app's app in its process (bridge.py), so
every route, error body, limit and metric is exactly `foveal serve`'s.

What the ingress adds, and only it can:
    - a replica that dies (kill -9, out of memory) under a call: the call answers a JSON 503
      `replica_unavailable` (Retry-After), a stream already under way ends with that error event
      and `data: [DONE]`; Ray restarts the replica, and the router drops the dead one at once;
    - `/health`: the replicas, each with Serve's state (RUNNING, STARTING, ...), pid, node and its
      own /health; 200 when at least one answers "ok";
    - `/metrics`: every replica's /metrics, each sample labelled `replica="ID"`, plus the caches'
      counts, the replicas by state and the ingress's own counts (fleet_metrics.py);
    - the drain on SIGTERM (replica_run.py drives it): `begin_drain` (new calls 503
      `shutting_down`, /health "stopping"), `end_grace` (calls still running are cut as
      `foveal serve` cuts them), `in_flight`.
Every answer carries `x-foveal-replica: ID`, the replica that gave it.
"""

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError, RequestCancelledError
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from foveal.server.admission import shutting_down
from foveal.server.affinity import PINNED, affinity_key
from foveal.server.bridge import Forwarded, Head, relay
from foveal.server.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from foveal.server.errors import ApiError
from foveal.server.fleet_metrics import cache_lines, ingress_lines, merge
from foveal.server.gate import Gate, refuse
from foveal.server.ops import PROMETHEUS_TEXT
from foveal.server.router import DEFAULT_IMBALANCE
from foveal.server.run import CUT_S
from foveal.server.state import CUT, NOT_ADMITTED, SHUTDOWN_FINAL
from foveal.server.streaming import sse

log = logging.getLogger("foveal.server")
REPLICA = "FovealReplica"
INGRESS = "FovealIngress"
ROUTER = "foveal.server.router:AffinityRouter"
PROBE_ROOM = 16  # requests a replica takes beyond --max-queue: /health and /metrics probes
PROBE_S = 5.0  # a replica's /health or /metrics that takes longer is "unreachable"
LARGE_BODY = 64 * 1024  # bodies parsed for their key off the event loop


class ReplicaArgs(BaseModel):
    """Everything the application needs: the model (`foveal.load`'s), the server's limits
    (ServerConfig), the scale (a fixed `replicas`, or `min_replicas`..`max_replicas` autoscaled
    to `target_ongoing` requests per replica), each replica's resources, and the routing
    ("affinity": router.py; "default": Ray Serve's power of two choices)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None
    device: str = "auto"
    max_batch_size: int = Field(32, ge=1)
    api_key: str | None = None
    max_queue: int = Field(256, ge=1)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)
    shutdown_grace: float = Field(10.0, ge=0)
    model_name: str = "foveal"
    replicas: int | None = Field(None, ge=1)
    min_replicas: int | None = Field(None, ge=1)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing: float = Field(16.0, gt=0)
    replica_cpus: float = Field(1.0, ge=0)
    replica_gpus: float | None = Field(None, ge=0)  # None: 0 here; the CLI picks 1 on a GPU cluster
    routing: Literal["affinity", "default"] = "affinity"
    imbalance: int = Field(default=DEFAULT_IMBALANCE, ge=1)

    @model_validator(mode="after")
    def _one_scale(self) -> "ReplicaArgs":
        autoscaled = self.min_replicas is not None or self.max_replicas is not None
        if autoscaled and self.replicas is not None:
            raise ValueError("give --replicas N or --min-replicas/--max-replicas (autoscaling), not both")
        if autoscaled and (self.min_replicas or 1) > (self.max_replicas or self.min_replicas or 1):
            raise ValueError(
                f"--min-replicas {self.min_replicas} is above --max-replicas {self.max_replicas}"
            )
        return self

    def server_config(self) -> ServerConfig:
        return ServerConfig(
            api_key=self.api_key or None,
            max_queue=self.max_queue,
            max_body_bytes=self.max_body_bytes,
            model_name=self.model_name,
            shutdown_grace_s=self.shutdown_grace,
        )

    @property
    def initial_replicas(self) -> int:
        """How many replicas the deployment starts with (the fixed count, or the autoscaling floor)."""
        return self.replicas or self.min_replicas or 1

    def scale(self) -> dict[str, Any]:
        """The replica deployment's num_replicas or autoscaling_config."""
        if self.min_replicas is None and self.max_replicas is None:
            return {"num_replicas": self.initial_replicas}
        low = self.initial_replicas
        return {
            "autoscaling_config": {
                "min_replicas": low,
                "initial_replicas": low,
                "max_replicas": self.max_replicas or low,
                "target_ongoing_requests": self.target_ongoing,
            }
        }


class FovealReplica:
    """One model and the app of app.py over it; the model loads in the constructor, so Serve counts
    the replica RUNNING (and routes to it) only once it can answer."""

    async def __init__(self, args: ReplicaArgs) -> None:  # type: ignore[misc]  # Ray Serve awaits an async constructor
        import foveal
        from foveal.server.app import create_app

        self.id = serve.get_replica_context().replica_id.unique_id

        def loader() -> Any:
            return foveal.load(args.model, device=args.device, max_batch_size=args.max_batch_size)

        self.app = create_app(loader=loader, config=args.server_config())
        self.state = self.app.state.foveal
        self.lifespan = contextlib.AsyncExitStack()
        await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        await self.state.loaded.wait()
        if self.state.load_error is not None:
            await self.lifespan.aclose()
            raise RuntimeError(f"the model could not be loaded: {self.state.load_error}")

    async def forward(self, request: Forwarded):
        async for piece in relay(self.app, request, self.id):
            yield piece

    async def observe(self, metrics: bool = False) -> dict[str, Any]:
        """This replica's /health (status and body); with `metrics`, its /metrics page and cache
        counts too (the fleet's /metrics asks for them, /health does not)."""
        health = await _collect(relay(self.app, Forwarded("GET", "/health"), self.id))
        seen: dict[str, Any] = {"replica": self.id, "health": health[1].decode(), "health_status": health[0]}
        if metrics:
            page = await _collect(relay(self.app, Forwarded("GET", "/metrics"), self.id))
            seen |= {"metrics": page[1].decode(), "caches": self.caches()}
        return seen

    def caches(self) -> dict[str, int]:
        model = self.state.model
        if model is None:
            return {}
        stats = model.engine.stats()
        counts = {
            "foveal_prompt_tokens_total": stats.get("prompt_tokens", 0),
            "foveal_prefix_cache_tokens_total": stats.get("cached_prompt_tokens", 0),
        }
        cache = getattr(getattr(model.family, "runner", None), "image_cache", None)
        if cache is not None:
            counts["foveal_image_cache_hits_total"] = cache.stats.hits
            counts["foveal_image_cache_misses_total"] = cache.stats.misses
        return counts

    def check_health(self) -> None:
        """Serve's health check: a replica whose model is gone is restarted."""
        if self.state.model is None or self.state.model.engine is None:
            raise RuntimeError("this replica has no model")

    async def __del__(self) -> None:
        """Serve stopping the replica (after its own wait for calls in flight): cut what is left,
        as `foveal serve` does at the end of its grace, then close the model."""
        self.state.end_grace()
        deadline = time.monotonic() + CUT_S
        while self.state.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.lifespan.aclose()


async def _collect(pieces: Any) -> tuple[int, bytes]:
    status, chunks = 500, []
    async for piece in pieces:
        if isinstance(piece, Head):
            status = piece.status
            chunks.append(piece.body)
        else:
            chunks.append(piece)
    return status, b"".join(chunks)


class _Stopped(Exception):
    """A relayed call ended by the ingress: its client left, or the shutdown cut it."""


class FovealIngress:
    """The HTTP ingress (the module docstring)."""

    def __init__(self, replicas: Any, args: ReplicaArgs) -> None:
        self.replicas = replicas
        self.args = args
        self.draining = False
        self.grace_over = asyncio.Event()
        self.calls = 0  # model calls in flight through this ingress
        self.replica_failures = 0
        self.statuses: dict[int, int] = defaultdict(int)

    def __serve_build_asgi_app__(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        routes = [
            Route("/health", self.health, methods=["GET", "HEAD"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        gated = Gate(Router(routes, default=self.forward), self.args.api_key, self.args.max_body_bytes)
        return self._counted(gated)

    # ---- the drain (replica_run.py) -----------------------------------------------------------
    def begin_drain(self) -> None:
        self.draining = True

    def end_grace(self) -> None:
        self.draining = True
        self.grace_over.set()

    def in_flight(self) -> int:
        return self.calls

    async def ready(self) -> int:
        """Replicas whose /health says "ok" through this ingress's router. replica_run.py waits for
        all the deployment starts with before it says it serves: the router learns the replicas
        from the controller one by one, and a key routed while it knows only some would find a
        new home once the rest arrive (its caches cold there)."""
        return sum(r.get("health") == "ok" for r in await self._fleet())

    # ---- forwarding ---------------------------------------------------------------------------
    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.draining:
            await refuse(send, shutting_down(NOT_ADMITTED))
            return
        body = await _body(receive)
        key = await asyncio.to_thread(affinity_key, body) if len(body) > LARGE_BODY else affinity_key(body)
        request = Forwarded(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            list(scope["headers"]),
            body,
            tuple(scope["client"]) if scope.get("client") else None,
        )
        self.calls += 1
        try:
            await self._relay(request, key, receive, send)
        finally:
            self.calls -= 1

    def _handle(self, key: str | None) -> Any:
        if self.args.routing == "affinity" and key is not None:
            return self.replicas.options(stream=True, method_name="forward", session_id=key)
        return self.replicas.options(stream=True, method_name="forward")

    async def _relay(self, request: Forwarded, key: str | None, receive: Receive, send: Send) -> None:
        pieces = self._handle(key).remote(request)
        stops: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.grace_over.wait()),
            asyncio.ensure_future(_gone(receive)),
        ]
        streaming = False
        try:
            try:
                head = await _next(pieces, stops)
            except _Stopped:
                await refuse(send, shutting_down(CUT))
                return
            except StopAsyncIteration:
                await refuse(send, ApiError(500, "the replica gave no answer", "internal_error"))
                return
            except Exception as error:
                await refuse(send, self._failed(error))
                return
            await send({"type": "http.response.start", "status": head.status, "headers": head.headers})
            await send({"type": "http.response.body", "body": head.body, "more_body": head.more})
            streaming = _is_event_stream(head.headers)
            more = head.more
            while more:
                more = await self._relay_next(pieces, stops, send, streaming)
        finally:
            for stop in stops:
                stop.cancel()
            pieces.cancel()

    async def _relay_next(
        self, pieces: Any, stops: list[asyncio.Future], send: Send, streaming: bool
    ) -> bool:
        """Send the next chunk of a response under way; whether more follows."""
        try:
            chunk = await _next(pieces, stops)
        except StopAsyncIteration:
            final = b""
        except _Stopped:
            final = b"".join(e.encode() for e in SHUTDOWN_FINAL) if streaming else b""
        except Exception as error:
            failure = self._failed(error)
            final = (sse(failure.body()) + sse("[DONE]")).encode() if streaming else b""
        else:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return True
        await send({"type": "http.response.body", "body": final, "more_body": False})
        return False

    def _failed(self, error: BaseException) -> ApiError:
        if isinstance(error, RayActorError | ReplicaUnavailableError | DeploymentUnavailableError):
            self.replica_failures += 1
            log.warning("a call's replica is gone: %s", type(error).__name__)
            return ApiError(
                503,
                "the replica serving this call stopped (it is being restarted); send it again",
                "replica_unavailable",
                headers={"Retry-After": "1"},
            )
        log.error("a relayed call failed: %s", error)
        return ApiError(500, "the replica failed on this call; see the server's log", "internal_error")

    # ---- operations ---------------------------------------------------------------------------
    async def health(self, request: Request) -> JSONResponse:
        replicas = await self._fleet()
        body: dict[str, Any] = {"model": self.args.model_name, "replicas": [_public(r) for r in replicas]}
        if self.draining:
            return _unavailable(body, "stopping", "the server is shutting down", "shutting_down")
        if any(r.get("health") == "ok" for r in replicas):
            return JSONResponse({"status": "ok", **body})
        if any(r["state"] in ("STARTING", "PENDING_MIGRATION", "RECOVERING") for r in replicas):
            return _unavailable(
                body, "loading", "the replicas are still loading; retry shortly", "model_not_ready"
            )
        return _unavailable(body, "unavailable", "no replica is serving", "replica_unavailable")

    async def metrics(self, request: Request) -> PlainTextResponse:
        replicas = await self._fleet(metrics=True)
        probed = [r for r in replicas if "metrics" in r]
        states: dict[str, int] = defaultdict(int)
        for r in replicas:
            states[r["state"]] += 1
        lines = merge((r["replica"], r["metrics"]) for r in probed)
        lines += cache_lines({r["replica"]: r["caches"] for r in probed})
        lines += ingress_lines(states, self.replica_failures, self.statuses)
        return PlainTextResponse("\n".join(lines) + "\n", media_type=PROMETHEUS_TEXT)

    async def _fleet(self, metrics: bool = False) -> list[dict[str, Any]]:
        """The replicas Serve knows (state, pid, node), each RUNNING one with its own observation."""
        known = await _serve_replicas()
        running = [r["replica"] for r in known if r["state"] == "RUNNING"]
        observed = await asyncio.gather(*(self._observe(rid, metrics) for rid in running))
        by_id = {o["replica"]: o for o in observed if o is not None}
        unseen = {"health": "unreachable"}  # RUNNING for Serve, but no answer within PROBE_S
        return [{**r, **by_id.get(r["replica"], unseen if r["state"] == "RUNNING" else {})} for r in known]

    async def _observe(self, replica: str, metrics: bool) -> dict[str, Any] | None:
        call = self.replicas.options(method_name="observe", session_id=PINNED + replica).remote(metrics)
        try:
            seen = await asyncio.wait_for(_result(call), PROBE_S)
        except Exception:  # dead, or too busy to answer within PROBE_S: shown as unreachable
            call.cancel()
            return None
        if seen["replica"] != replica:  # the router did not know it yet: another one answered
            return None
        status = _health_status(seen["health"])
        return {**seen, "health": status}

    def _counted(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> Any:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            async def watched(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    self.statuses[message["status"]] += 1
                await send(message)

            await app(scope, receive, watched if scope["type"] == "http" else send)

        return counted


async def _next(pieces: Any, stops: list[asyncio.Future]) -> Any:
    """The next piece of a relayed answer, or _Stopped when a stop (grace over, client gone) comes first."""
    step = asyncio.ensure_future(pieces.__anext__())
    done, _ = await asyncio.wait([step, *stops], return_when=asyncio.FIRST_COMPLETED)
    if step in done:
        return step.result()
    step.cancel()
    with contextlib.suppress(BaseException):
        await step
    raise _Stopped


async def _result(call: Any) -> Any:
    return await call  # a coroutine: wait_for's cancellation then cancels the call itself


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise RequestCancelledError("the client left before sending its body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _gone(receive: Receive) -> None:
    """Returns once the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _health_status(body: str) -> str:
    import json

    try:
        return str(json.loads(body).get("status", "unknown"))
    except ValueError:
        return "unknown"


def _public(replica: dict[str, Any]) -> dict[str, Any]:
    return {k: replica.get(k) for k in ("replica", "state", "health", "pid", "node")}


def _unavailable(body: dict[str, Any], status: str, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"status": status, **body, **ApiError(503, message, code).body()}, 503, {"Retry-After": "5"}
    )


async def _serve_replicas() -> list[dict[str, Any]]:
    """This application's FovealReplica replicas as Serve's controller lists them.

    Serve's public `serve.status()` counts replicas by state but names none; the replicas' ids,
    pids and nodes are in the controller's instance details (the `serve status` CLI's and the
    dashboard's source), read here through Serve's client."""
    from ray.serve.context import _get_global_client

    app = serve.get_replica_context().app_name
    try:
        client = _get_global_client()
        assert client is not None  # this runs in a replica of a running Serve application
        details = await asyncio.wait_for(asyncio.to_thread(client.get_serve_details), PROBE_S)
    except Exception as error:
        log.warning("the Serve controller did not list the replicas: %s", error)
        return []
    deployment = details.get("applications", {}).get(app, {}).get("deployments", {}).get(REPLICA, {})
    return [
        {
            "replica": r["replica_id"],
            "state": str(getattr(r["state"], "value", r["state"])),
            "pid": r.get("pid"),
            "node": r.get("node_ip"),
        }
        for r in deployment.get("replicas", [])
    ]


def application(args: ReplicaArgs) -> Any:
    """The Serve application: the ingress over the replica deployment."""
    replica_options: dict[str, Any] = {
        **args.scale(),
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus or 0},
        "max_ongoing_requests": args.max_queue + PROBE_ROOM,
        "graceful_shutdown_timeout_s": args.shutdown_grace + CUT_S,
        "health_check_period_s": 5.0,
    }
    if args.routing == "affinity":
        replica_options["request_router_config"] = {
            "request_router_class": ROUTER,
            "request_router_kwargs": {"imbalance": args.imbalance},
        }
    replica = serve.deployment(name=REPLICA, **replica_options)(FovealReplica)
    ingress = serve.deployment(
        name=INGRESS,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=16 * (args.max_queue + PROBE_ROOM),
    )(serve.ingress()(FovealIngress))
    return ingress.bind(replica.bind(args), args)


def build_app(args: ReplicaArgs) -> Any:
    """`serve run foveal.server.replicas:build_app replicas=2 model=/models/md2` and the
    `import_path` of a `serve deploy` config file (whose `args:` are ReplicaArgs' fields)."""
    return application(args)
