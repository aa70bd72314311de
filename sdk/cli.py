"""The `foveal` command line: one sub-command per skill, plus `demo`, `--version` and `--help`.

    foveal detect IMAGE OBJECT [--out annotated.png] [--json]
    foveal point IMAGE OBJECT [--out annotated.png] [--json]
    foveal caption IMAGE [--length short|normal|long] [--json]
    foveal query IMAGE QUESTION [--json]
    foveal demo [IMAGE] [--object PHRASE] [--seed N] [--out foveal-demo.png]
    foveal batch INPUT --skill SKILL [--object X ...] --out RESULTS.jsonl [--resume] [--ray]   (foveal.batch)
    foveal serve [--model PATH] [--host 127.0.0.1] [--port 2020] [--api-key KEY] [--quiet]   (foveal.server)
    foveal serve --replicas N [--ray-address ADDR] [--replica-cpus C] [--replica-gpus G]   (Ray Serve replicas)

Every command takes `--model PATH` (default: the embedded model) and `--device`. Without `--json`
the answer is printed for people (captions and answers stream as they are generated); with it, the
result dict is printed as JSON. Bad input exits with status 2 and one line on stderr saying what
to fix, before any work: arguments that can be checked without the model (the IMAGE file,
`--model`, `--out`, `--size`, `--device`, `--max-tokens`, `--max-objects`) are checked before it loads. A failure while generating exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import foveal
from foveal.batch.cli import add_command as add_batch_command
from foveal.cli_common import check_device, fail, quiet_loading

DEMO_SIZES = (32, 2048)  # scene side in pixels: the shapes world's smallest, and a sane largest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foveal",
        description="Vision-language models with structured output (boxes, points, JSON, regex, grammars).",
    )
    parser.add_argument("--version", action="version", version=f"foveal {foveal.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_batch_command(commands)  # foveal.batch.cli: light at import, torch loads when a batch runs

    for name, what in (("detect", "boxes of every OBJECT"), ("point", "points on every OBJECT")):
        sub = _command(commands, name, f"{what} in IMAGE")
        sub.add_argument("image", metavar="IMAGE", help="image file")
        sub.add_argument("object", metavar="OBJECT", help='object phrase, e.g. "red circle"')
        sub.add_argument("--out", metavar="PNG", help="write the image with the answer drawn on it")
        sub.add_argument("--max-objects", type=int, default=None, help="at most this many answers")

    sub = _command(commands, "caption", "describe IMAGE")
    sub.add_argument("image", metavar="IMAGE", help="image file")
    sub.add_argument("--length", choices=("short", "normal", "long"), default="normal")

    sub = _command(commands, "query", "answer QUESTION about IMAGE")
    sub.add_argument("image", metavar="IMAGE", help="image file")
    sub.add_argument("question", metavar="QUESTION")

    sub = _command(commands, "demo", "detect, point and caption on a generated shapes scene (or IMAGE)")
    sub.add_argument("image", metavar="IMAGE", nargs="?", default=None, help="image file (default: a scene)")
    sub.add_argument(
        "--object", default=None, help="what to find (default: the scene's first object; 'shape' for IMAGE)"
    )
    sub.add_argument("--seed", type=int, default=0, help="scene seed")
    sub.add_argument(
        "--size",
        type=int,
        default=160,
        help="scene width and height in pixels, 32 to 2048 (default: %(default)s)",
    )
    sub.add_argument(
        "--out", metavar="PNG", default="foveal-demo.png", help="annotated image (default: %(default)s)"
    )
    _serve_command(commands)
    return parser


def _serve_command(commands: Any) -> None:
    help_text = "serve Moondream's REST API, OpenAI's chat API and a playground page over HTTP"
    sub = commands.add_parser("serve", help=help_text, description=help_text)
    sub.add_argument(
        "--model", metavar="PATH", default=None, help="checkpoint folder (default: the embedded model)"
    )
    sub.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    sub.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    sub.add_argument("--port", type=int, default=2020, help="port (default: %(default)s, Moondream's)")
    sub.add_argument(
        "--api-key",
        default=os.environ.get("FOVEAL_API_KEY"),
        help="required from clients (default: $FOVEAL_API_KEY)",
    )
    sub.add_argument(
        "--max-queue", type=int, default=256, help="calls in flight before 429 (default: %(default)s)"
    )
    sub.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 2**20,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    sub.add_argument(
        "--max-batch-size", type=int, default=32, help="sequences decoded together (default: %(default)s)"
    )
    sub.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, calls in flight get this long to finish, then are answered 503 "
        "(default: %(default)s)",
    )
    sub.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a client has this long to send a whole request, then it is disconnected (default: ServerConfig's "
        "read_timeout_s, 30; one process only: with --replicas, Ray Serve's proxy reads the requests)",
    )
    sub.add_argument(
        "--quiet", action="store_true", help="no request log, no progress bar or transformers warning on load"
    )
    _replica_arguments(sub.add_argument_group("replicas on Ray Serve (docs/serving.md#replicas)"))


def _replica_arguments(group: Any) -> None:
    """`foveal serve --replicas N` or --min-replicas/--max-replicas: the app as Ray Serve replicas
    (foveal.server.replica_cli); without them, `foveal serve` is one process."""
    group.add_argument(
        "--replicas", type=int, default=None, metavar="N", help="N replicas behind one endpoint"
    )
    group.add_argument(
        "--min-replicas", type=int, default=None, metavar="N", help="autoscaling: fewest replicas"
    )
    group.add_argument(
        "--max-replicas", type=int, default=None, metavar="N", help="autoscaling: most replicas"
    )
    group.add_argument(
        "--target-ongoing",
        type=float,
        default=16.0,
        metavar="N",
        help="autoscaling: requests in flight per replica to scale at (default: %(default)s)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="an existing Ray cluster (default: $RAY_ADDRESS, else local)",
    )
    group.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs per replica (default: %(default)s)"
    )
    group.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        help="GPUs per replica (default: 1 on a cluster with GPUs, else 0)",
    )
    group.add_argument(
        "--routing",
        choices=("affinity", "default"),
        default="affinity",
        help="affinity: the same image to the same replica; default: Ray Serve's (default: %(default)s)",
    )


def _command(commands: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.add_argument(
        "--model", metavar="PATH", default=None, help="checkpoint folder (default: the embedded model)"
    )
    sub.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    sub.add_argument("--json", action="store_true", help="print the result as JSON")
    sub.add_argument("--max-tokens", type=int, default=None, help="answer length limit in tokens")
    return sub


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stdout)
        return 0
    if args.command == "batch":  # checks INPUT and --out itself, loads the model (or Ray) when they pass
        from foveal.batch.cli import run_command

        return run_command(args)
    try:
        check_args(args)
    except ValueError as error:
        return fail(error, 2)
    if args.command == "serve":
        return run_serve(args)
    quiet_loading()
    try:
        model = foveal.load(args.model, device=args.device)
    except (ValueError, TypeError, OSError) as error:  # ModelLoadError is a ValueError
        return fail(error, 2)
    try:
        return COMMANDS[args.command](model, args)
    except (ValueError, TypeError) as error:  # ImageError, SchemaError and bad settings are ValueErrors
        return fail(error, 2)
    except RuntimeError as error:  # GenerationError, IncompleteOutputError
        return fail(error, 1)
    finally:
        model.close()


def check_args(args: argparse.Namespace) -> None:
    """What can be refused before the model loads: the device name, the demo's scene size, the
    IMAGE file, --model, --max-tokens, --max-objects and --out."""
    check_device(args.device)
    low, high = DEMO_SIZES
    if args.command == "demo" and not low <= args.size <= high:
        raise ValueError(f"--size {args.size} is not accepted; use {low} to {high} pixels")
    for flag in ("max_tokens", "max_objects"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} is not accepted; use 1 or more")
    if getattr(args, "image", None) is not None:
        check_image(args.image)
    if args.command != "serve":
        check_model_path(getattr(args, "model", None))
    if getattr(args, "out", None):
        check_out(args.out)


def check_image(image: str) -> None:
    """IMAGE must be a readable file whose header PIL recognises (the pixels are decoded later)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(image)
    if not path.exists():
        raise ValueError(f"IMAGE {image}: no such file; pass the path of an image file")
    if path.is_dir():
        raise ValueError(f"IMAGE {image} is a folder; pass one image file (foveal batch reads folders)")
    try:
        with Image.open(path) as opened:
            opened.format  # noqa: B018 - the header is read by open
    except UnidentifiedImageError:
        raise ValueError(f"IMAGE {image} is not an image PIL can read (PNG, JPEG, WebP, ...)") from None
    except OSError as error:
        raise ValueError(f"IMAGE {image} cannot be read: {error.strerror or error}") from None


def check_model_path(model: str | None) -> None:
    """--model must name a folder, a file or a hub id 'org/name' (what foveal.load takes)."""
    from foveal.engine.models.hub import looks_like_hub_id

    if model is not None and not Path(model).exists() and not looks_like_hub_id(model):
        raise ValueError(
            f"--model {model}: no such folder or file, and not a hub id 'org/name'; pass a "
            "checkpoint folder, a .gguf file or the id of a model in the Hugging Face cache"
        )


def check_out(out: str) -> None:
    """--out must name a new or existing image file (by its extension) in a writable folder."""
    from PIL import Image

    path = Path(out)
    if path.is_dir():
        raise ValueError(f"--out {out} is a folder; name an image file in it, e.g. {path / 'annotated.png'}")
    if path.suffix.lower() not in Image.registered_extensions():
        raise ValueError(f"--out {out} has no image extension PIL can write; use e.g. .png or .jpg")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"--out {out}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--out {out} cannot be written (permission denied); choose another path")


# ---- commands --------------------------------------------------------------------------------------------------


def run_spatial(model: foveal.Model, args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.max_objects is not None:
        settings["max_objects"] = args.max_objects
    result = getattr(model, args.command)(args.image, args.object, settings=settings)
    if args.out:
        result.annotated().save(args.out)
    if args.json:
        _print_json(result)
    else:
        _print_spatial(result, args.object)
        if args.out:
            print(f"annotated image: {args.out}")
    return 0


def run_text(model: foveal.Model, args: argparse.Namespace) -> int:
    """caption and query: stream to the terminal, or print the whole result as JSON."""
    if args.command == "caption":
        call, key = (
            (lambda stream: model.caption(args.image, args.length, stream, _settings(args))),
            "caption",
        )
    else:
        call, key = (lambda stream: model.query(args.image, args.question, stream=stream, settings=_settings(args))), "answer"
    if args.json:
        _print_json(call(False))
        return 0
    for chunk in call(True)[key]:
        print(chunk, end="", flush=True)
    print()
    return 0


def run_demo(model: foveal.Model, args: argparse.Namespace) -> int:
    from foveal.vision import draw, load_image, scenes

    if args.image is None:
        scene = scenes.generate_scene(args.seed, args.size)
        image = scenes.render(scene)
        phrase = args.object or scene.objects[0].phrase()
    else:
        scene, image, phrase = None, load_image(args.image), args.object or "shape"
    few = {**_settings(args), "max_objects": scenes.MAX_OBJECTS}  # the shapes world never has more
    detected = model.detect(image, phrase, few)
    pointed = model.point(image, phrase, few)
    caption = model.caption(image, settings=_settings(args))
    draw(image, {"objects": detected["objects"], "points": pointed["points"]}).save(args.out)
    if scene is None:
        source = {"image": args.image, "size": list(image.size), "object": phrase}
    else:
        source = {"scene": {"seed": args.seed, "size": [scene.width, scene.height], "object": phrase}}
    report = {**source, "detect": detected, "point": pointed, "caption": caption["caption"]}
    if scene is not None:
        truth = [o.box(scene.width, scene.height) for o in scenes.objects_matching(scene, phrase)]
        report["truth"] = {"objects": [_box(b) for b in truth], "caption": scenes.caption(scene)}
    _print_json({**report, "annotated": args.out})
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Check every argument (exit 2, one line), then hand over to foveal.server.run, whose docstring
    gives the order of what follows: bind, listen while loading, serve, stop."""
    try:  # heavy imports (fastapi, uvicorn) only for this command
        from foveal.server import ServerConfig
        from foveal.server.run import serve
    except ImportError as error:
        return fail(f"{error}; install the server's dependencies: pip install -e '.[serve]' in foveal's clone", 2)
    try:
        config = ServerConfig(
            api_key=args.api_key or None,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            shutdown_grace_s=args.shutdown_grace,
            **({} if args.read_timeout is None else {"read_timeout_s": args.read_timeout}),
        )
        check_serve_args(args)
    except ValueError as error:  # ModelLoadError is a ValueError
        return fail(error, 2)

    if any(getattr(args, f) is not None for f in ("replicas", "min_replicas", "max_replicas")):
        from foveal.server.replica_cli import run_replicas

        if args.read_timeout is not None:  # no proxy setting means "the whole request within N s"
            return fail(
                "--read-timeout applies to one process's server; with --replicas, Ray Serve's proxy "
                "reads the requests (see docs/serving.md#replicas)",
                2,
            )
        return run_replicas(args)

    def loader() -> foveal.Model:
        return foveal.load(args.model, device=args.device, max_batch_size=args.max_batch_size)

    return serve(loader, args.host, args.port, config, quiet=args.quiet)


def check_serve_args(args: argparse.Namespace) -> None:
    """What `foveal serve` refuses before it binds its port or loads: a port out of range, a batch
    size below 1, a device torch does not have, a --model that names nothing."""
    from foveal.engine.models.loader import resolve_device

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a port; use 0 to 65535 (0: any free port)")
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size {args.max_batch_size} is not accepted; use 1 or more")
    try:
        resolve_device(args.device)
    except ValueError as error:
        raise ValueError(f"--device {args.device}: {error}") from None
    check_model_path(args.model)


COMMANDS = {
    "detect": run_spatial,
    "point": run_spatial,
    "caption": run_text,
    "query": run_text,
    "demo": run_demo,
}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.max_tokens is None else {"max_tokens": args.max_tokens}


def _box(box: tuple[float, float, float, float]) -> dict[str, float]:
    return dict(zip(("x_min", "y_min", "x_max", "y_max"), box, strict=True))


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def _print_spatial(result: dict, phrase: str) -> None:
    key, one, many = ("objects", "box", "boxes") if "objects" in result else ("points", "point", "points")
    items = result[key]
    print(f"{len(items)} {one if len(items) == 1 else many} for {phrase!r}")
    for item in items:
        print("  " + "  ".join(f"{name}={value:.3f}" for name, value in item.items()))
