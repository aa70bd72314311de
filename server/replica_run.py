"""`serve_replicas()`: what `foveal serve --replicas N` (or --min-replicas/--max-replicas) runs,
from Ray's start to its exit status. cli.py has checked the arguments (exit 2, one line).

ORDER
    1. host:port is bound once and let go (a port in use or an address not this machine's exits
       2 with run.py's message, before Ray starts); --port 0 picks the free port Serve then uses.
    2. Ray: the cluster at --ray-address (or $RAY_ADDRESS), else a local instance this process
       starts. An address that does not answer exits 2 with one line. On a local instance, replicas
       that cannot all fit its CPUs / GPUs exit 2 (Serve would wait for them for good).
    3. Serve's HTTP proxy on host:port, then the application (replicas.py) deployed; one line
       says the replicas are loading. `serve.run` returns once every replica has loaded its
       model; a replica that cannot load fails the deployment: one line, exit 1. Then it waits
       until the ingress's router reaches every replica the deployment starts with (affinity:
       a key routed while it knows only some would move once the rest arrive).
    4. `foveal: serving on URL (N replicas on Ray ...)`; serve until SIGINT or SIGTERM.
    5. Drain, as `foveal serve` does (run.py's SHUTDOWN): the ingress refuses new calls (503
       `shutting_down`, /health "stopping"), calls in flight get --shutdown-grace seconds (a
       second signal ends the wait), then the rest are cut (503, or an error event and [DONE]).
    6. Stop what this process started: the application is deleted (Serve stops each replica, which
       closes its model); Serve itself if it was not running before; the local Ray instance if
       this process started it. `foveal: stopped`, exit 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any

from foveal.server.run import CUT_S, bind

APP = "foveal"
POLL_S = 0.1
REACH_S = 5.0
READY_S = 60.0
INSTALL = "pip install -c constraints.txt -e '.[ray]' in foveal's clone (or pip install 'ray[serve]')"


class _Stop(Exception):
    """SIGINT or SIGTERM before the application was up."""


def require_serve() -> None:
    """ImportError with what to install when Ray Serve is missing."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"--replicas runs on Ray Serve, which is not installed ({error}); {INSTALL}"
        ) from None


def serve_replicas(args: Any, host: str, port: int, ray_address: str | None, quiet: bool = False) -> int:
    """Steps 1 to 6 of the module docstring; `args` is a replicas.ReplicaArgs (replica_gpus None: one
    GPU per replica when the cluster has GPUs and --device is not cpu). Returns the exit status."""
    try:
        listener = bind(host, port)
    except OSError as error:
        print(f"foveal: error: {error}", file=sys.stderr)
        return 2
    port = listener.getsockname()[1]
    listener.close()
    return _run(args, host, port, ray_address, quiet)


def _run(args: Any, host: str, port: int, ray_address: str | None, quiet: bool) -> int:
    import ray
    from ray import serve

    address = ray_address or os.environ.get("RAY_ADDRESS") or None
    started_ray = address is None and not ray.is_initialized()
    try:
        _connect(ray, address, quiet)
        args = _with_resources(ray, args)
        if started_ray:
            _check_fits(ray, args)
    except (ConnectionError, ValueError, _Stop) as error:
        if started_ray and ray.is_initialized():
            ray.shutdown()
        if isinstance(error, _Stop):
            return 0
        print(f"foveal: error: {error}", file=sys.stderr)
        return 2
    stop = _Signals()
    with stop.installed():  # after ray.init, which puts its own SIGTERM handler in place
        return _serve(ray, serve, args, host, port, address, stop, started_ray)


def _serve(
    ray: Any,
    serve: Any,
    args: Any,
    host: str,
    port: int,
    address: str | None,
    stop: _Signals,
    started_ray: bool,
) -> int:
    """Steps 3 to 6."""
    started_serve = not _serve_running(ray)
    try:
        serve.start(http_options={"host": host, "port": port})
        url = _url(host, port)
        where = address or "a local instance"
        print(
            f"foveal: loading {_fleet(args)} on Ray ({where}); {url}/health answers once one is ready",
            flush=True,
        )
        if not _deploy(serve, args) or not wait_ready(serve, APP, args.initial_replicas, READY_S):
            return 1
        print(
            f"foveal: serving on {url} ({_fleet(args)}, playground {url}/, Moondream and OpenAI APIs at {url}/v1)",
            flush=True,
        )
        stop.serving = True
        stop.wait()
        _drain(serve, args.shutdown_grace, stop)
        return 0
    except _Stop:
        return 0
    finally:
        _teardown(ray, serve, started_serve, started_ray)
        print("foveal: stopped", flush=True)


def _connect(ray: Any, address: str | None, quiet: bool) -> None:
    if ray.is_initialized():
        return
    if address is not None:
        _check_reachable(address)
    try:
        ray.init(
            address=address, log_to_driver=not quiet, include_dashboard=False, configure_logging=not quiet
        )
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise ConnectionError(
            f"cannot reach {where}: {' '.join(str(error).split())[:300]}; check --ray-address "
            "(host:port of the head node's GCS, e.g. 10.0.0.1:6379, or ray://host:10001), or leave it "
            "out to start a local instance"
        ) from None


def _check_reachable(address: str) -> None:
    """A host:port that refuses connections fails at once (ray.init would retry it for minutes)."""
    where = address.removeprefix("ray://")
    host, sep, port = where.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return  # "auto", or a form ray.init itself explains
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_S).close()
    except OSError as error:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address}: {error.strerror or error}; check --ray-address "
            "(the head node's host:port, e.g. 10.0.0.1:6379, or ray://host:10001), or leave it out to "
            "start a local instance"
        ) from None


def _with_resources(ray: Any, args: Any) -> Any:
    if args.replica_gpus is not None:
        return args
    gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 and args.device != "cpu" else 0.0
    return args.model_copy(update={"replica_gpus": gpus})


def _check_fits(ray: Any, args: Any) -> None:
    """On the local instance this process started, the replicas must fit its resources."""
    have = ray.cluster_resources()
    first = args.replicas or args.min_replicas or 1
    for name, each, flag in (
        ("CPU", args.replica_cpus, "--replica-cpus"),
        ("GPU", args.replica_gpus, "--replica-gpus"),
    ):
        need = first * each
        if need > have.get(name, 0) + 1e-9:
            raise ValueError(
                f"{first} replicas x {flag} {each:g} need {need:g} {name}s and this machine has "
                f"{have.get(name, 0):g}; lower {flag} (e.g. {have.get(name, 0) / first:g}) or the replicas"
            )


def _serve_running(ray: Any) -> bool:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _url(host: str, port: int) -> str:
    """The proxy's URL (Serve already running on a cluster keeps the host and port it has)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # Serve was started (or found) before the URL is asked
    config = client.http_config
    host, port = config.host or host, config.port or port
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _fleet(args: Any) -> str:
    if args.replicas is not None or args.min_replicas is None and args.max_replicas is None:
        n = args.replicas or 1
        count = f"{n} replica{'s' if n != 1 else ''}"
    else:
        count = f"{args.min_replicas or 1} to {args.max_replicas or args.min_replicas} replicas (autoscaled)"
    return f"{count} of {args.model or 'the embedded model'}"


def _deploy(serve: Any, args: Any) -> bool:
    from foveal.server.replicas import application

    try:
        serve.run(application(args), name=APP, route_prefix="/", blocking=False)
    except RuntimeError as error:  # a replica that could not load: its message, first line
        print(
            f"foveal: error: the replicas could not start: {_first_line(error)}", file=sys.stderr, flush=True
        )
        return False
    return True


def wait_ready(serve: Any, app: str, replicas: int, seconds: float) -> bool:
    """Whether `replicas` replicas answered "ok" through the ingress within `seconds` (the
    deployment is up, but the ingress's router may not have learnt of them all yet)."""
    ingress = serve.get_app_handle(app)
    deadline = time.monotonic() + seconds
    ready = 0
    while time.monotonic() < deadline:
        ready = ingress.ready.remote().result()
        if ready >= replicas:
            return True
        time.sleep(POLL_S)
    print(
        f"foveal: error: {ready} of {replicas} replicas answered /health within {seconds:g} s",
        file=sys.stderr,
        flush=True,
    )
    return False


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    loaded = [line for line in lines if "could not be loaded" in line]
    return (loaded or lines or [type(error).__name__])[-1][:500]


def _drain(serve: Any, grace: float, stop: _Signals) -> None:
    """Step 5."""
    ingress = serve.get_app_handle(APP)
    ingress.begin_drain.remote().result()
    _wait_until(lambda: ingress.in_flight.remote().result() == 0, grace, stop)
    ingress.end_grace.remote().result()
    _wait_until(lambda: ingress.in_flight.remote().result() == 0, CUT_S, None)


def _wait_until(done: Any, seconds: float, stop: _Signals | None) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline and not (stop and stop.forced):
        time.sleep(POLL_S)


def _teardown(ray: Any, serve: Any, started_serve: bool, started_ray: bool) -> None:
    """Step 6: only what this process started."""
    if not ray.is_initialized():
        return
    try:
        if started_ray or started_serve:
            serve.shutdown()
        else:
            serve.delete(APP)
    finally:
        if started_ray:
            ray.shutdown()


class _Signals:
    """SIGINT and SIGTERM: before the application is up, they stop the start (`_Stop`); then the first
    one starts the drain, and a second ends its grace early (as `foveal serve`)."""

    def __init__(self) -> None:
        self.serving = False
        self.forced = False
        self._event = threading.Event()

    def installed(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def handlers() -> Any:
            signals = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self._handle) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        return handlers()

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        if self._event.is_set():
            self.forced = True
            return
        self._event.set()
        if not self.serving:
            raise _Stop

    def wait(self) -> None:
        while not self._event.wait(0.5):  # a timed wait lets the handler run promptly
            pass
