"""`run_replicas()`: `foveal serve --replicas N` (or --min-replicas/--max-replicas) from the parsed
command line: what cli.py hands over once it has checked the arguments `foveal serve` shares
(port, device, --model, the server's limits).

Refused here, before Ray starts (exit 2, one line): Ray Serve not installed (with what to install),
replica options out of range or in conflict (--replicas with autoscaling, min above max, negative
resources). The rest is replica_run.py's.
"""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from foveal.cli_common import fail

FLAGS = {  # ReplicaArgs field: the flag that sets it (for the one-line message)
    "replicas": "--replicas",
    "min_replicas": "--min-replicas",
    "max_replicas": "--max-replicas",
    "target_ongoing": "--target-ongoing",
    "replica_cpus": "--replica-cpus",
    "replica_gpus": "--replica-gpus",
    "max_batch_size": "--max-batch-size",
    "max_queue": "--max-queue",
    "max_body_bytes": "--max-body-bytes",
    "shutdown_grace": "--shutdown-grace",
}


def run_replicas(args: argparse.Namespace) -> int:
    from foveal.server.replica_run import require_serve, serve_replicas

    try:
        require_serve()
    except ImportError as error:
        return fail(error, 2)
    from foveal.server.replicas import ReplicaArgs

    try:
        replica_args = ReplicaArgs(
            model=args.model,
            device=args.device,
            max_batch_size=args.max_batch_size,
            api_key=args.api_key or None,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            shutdown_grace=args.shutdown_grace,
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing=args.target_ongoing,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            routing=args.routing,
        )
    except ValidationError as error:
        return fail(one_line(error), 2)
    return serve_replicas(replica_args, args.host, args.port, args.ray_address, quiet=args.quiet)


def one_line(error: ValidationError) -> str:
    """The first problem pydantic found, in the command line's words."""
    problem = error.errors()[0]
    field = str(problem["loc"][0]) if problem.get("loc") else ""
    message = problem["msg"].removeprefix("Value error, ")
    if field in FLAGS:
        return f"{FLAGS[field]} {problem.get('input')!r} is not accepted: {message.lower()}"
    return message
