"""Image-affine routing for `foveal serve --replicas`: a request's affinity key, and the rule that
turns a key into a replica.

PROBLEM
    Repeated calls are cheap on one engine because its caches hit: the image's KV pages and
    features (keyed by the image), and the prompt's full KV pages (the prefix cache). Spread over
    N replicas at random, a repeated image lands on a replica that has not seen it (N-1 times in
    N), and each replica keeps its own copy of every image. Yet pinning every image to one replica
    for good would let one busy image overload its replica while the others idle.
SOLUTION
    `affinity_key(body)`: the key of a request, from its JSON body: "image:" + a hash of the first
    image data URL in it (Moondream's `image_url`, an OpenAI `image_url` part, /v1/generate's
    `image_url`), else "prefix:" + a hash of the first PREFIX_CHARS characters of its text (the
    prompt, question or chat turns), else None (no body, /v1/models, the playground page).
    The image is found by a byte search for the first `"data:` string, not by parsing: the
    ingress keys every request on one event loop, and an image body is megabytes of base64 that
    json.loads would turn into a Python string only to hash it (the replica parses it anyway).
    `rank(key, replica_ids)`: rendezvous (highest random weight) hashing: every replica gets a
    score hash(key, replica id) and the highest wins. Every router computes the same winner with
    no shared state, and a replica that leaves or joins moves only the keys it wins.
    `home_or_any(...)`: the home replica, unless its requests in flight exceed the least loaded
    replica's by `imbalance` or more: then the least loaded (bounded-load hashing).
INVARIANTS
    - The same image (the same data URL) gives the same key, whatever the route or the question.
    - `rank` depends only on the key and the set of ids, not on their order.
    - Bodies that are not JSON, or carry neither image nor text, have no key (least loaded).
    - A body whose image URL is written without escapes (as every JSON library writes one) is
      never parsed here, however large.

`router.py` applies these rules inside Ray Serve's request router; this module imports no Ray, so
that it is tested and used (the benchmark's workload) without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX_CHARS = 256  # a system prompt or a question template: longer shared text is rarer
PINNED = "replica:"  # a key naming one replica: /health and /metrics ask each replica in turn
TEXT_FIELDS = ("prompt", "question", "object")


def affinity_key(body: bytes) -> str | None:
    """The routing key of a request body (the module docstring); None for no affinity."""
    if not body:
        return None
    image = _first_data_url(body)
    if image is not None:
        return "image:" + hashlib.blake2b(image, digest_size=16).hexdigest()
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the replica answers the 400; any replica may
    text = _text(parsed)[:PREFIX_CHARS]
    return "prefix:" + _digest(text) if text else None


def rank(key: str, replica_ids: Iterable[str]) -> list[str]:
    """The replica ids from the key's home to its last choice (rendezvous hashing)."""
    return sorted(replica_ids, key=lambda rid: (_score(key, rid), rid), reverse=True)


def home_or_any(key: str, loads: Mapping[str, int], imbalance: int) -> str | None:
    """The key's home replica, or None (route to the least loaded) when the home's requests in
    flight exceed the least loaded replica's by `imbalance` or more. `loads`: in flight by id."""
    if not loads:
        return None
    home = rank(key, loads)[0]
    return None if loads[home] - min(loads.values()) >= imbalance else home


def _first_data_url(body: bytes) -> bytes | None:
    """The bytes of the first JSON string in `body` that starts with "data:", unparsed.

    A data URL's base64 holds no quote and no backslash, and JSON writes an image URL with
    neither; a string that has an escape (`\\/`, say) ends the search: the body then keys on its
    text, which is right but colder, never wrong."""
    at = body.find(b'"data:')
    while at > 0 and body[at - 1] == 0x5C:  # an escaped quote inside some text: not a string's start
        at = body.find(b'"data:', at + 1)
    if at < 0:
        return None
    end = body.find(b'"', at + 1)
    if end < 0 or body.find(b"\\", at, end) >= 0:
        return None
    return body[at + 1 : end]


def _text(body: Any) -> str:
    """The request's text in prompt order: the chat turns' texts, else the prompt fields."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(_message_text(m) for m in messages if isinstance(m, dict))
    return "\n".join(body[f] for f in TEXT_FIELDS if isinstance(body.get(f), str))


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _score(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
