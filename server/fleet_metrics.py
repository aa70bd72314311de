"""`merge()`: the `/metrics` of every replica as one Prometheus text page (format 0.0.4), each
sample labelled with its replica; `cache_lines()` and `ingress_lines()`, what only the fleet has.

Prometheus' text format wants all the samples of one metric family in one group, under its HELP
and TYPE lines; pasting the replicas' pages one after another would repeat every family. So each
page is parsed into families (a family is the last TYPE line's name; a histogram's `_bucket`,
`_sum` and `_count` samples follow it), the samples gain `replica="ID"` as their first label, and
each family is written once with the samples of every replica, in the order the pages came.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class _Family:
    help: str = ""
    type: str = ""
    samples: list[str] = field(default_factory=list)


def merge(pages: Iterable[tuple[str, str]]) -> list[str]:
    """The lines of (replica id, metrics page) pairs merged by family (the module docstring)."""
    families: dict[str, _Family] = {}
    for replica, page in pages:
        current = None
        for line in page.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                _, kind, name, *rest = line.split(" ", 3)
                family = families.setdefault(name, _Family())
                setattr(family, "help" if kind == "HELP" else "type", rest[0] if rest else "")
                current = family
            elif line and not line.startswith("#"):
                if current is None:
                    current = families.setdefault(line.split("{")[0].split(" ")[0], _Family())
                current.samples.append(labelled(line, replica))
    lines: list[str] = []
    for name, family in families.items():
        lines += _family_head(name, family.type or "untyped", family.help)
        lines += family.samples
    return lines


def labelled(sample: str, replica: str) -> str:
    """`sample` with `replica="ID"` as its first label."""
    label = f'replica="{replica}"'
    name, sep, rest = sample.partition("{")
    if sep:
        return f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
    name, _, value = sample.partition(" ")
    return f"{name}{{{label}}} {value}"


def cache_lines(caches: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Each replica's cache counts (replicas.py `FovealReplica.caches`): the prefix cache's prompt
    tokens and those it served, the image-feature cache's hits and misses."""
    lines: list[str] = []
    for name, help_text in (
        ("foveal_prompt_tokens_total", "prompt tokens prefilled or served by the prefix cache"),
        ("foveal_prefix_cache_tokens_total", "prompt tokens the prefix cache served (KV pages reused)"),
        ("foveal_image_cache_hits_total", "image-feature cache hits (the vision tower skipped)"),
        ("foveal_image_cache_misses_total", "image-feature cache misses"),
    ):
        lines += _family_head(name, "counter", help_text)
        lines += [f'{name}{{replica="{rid}"}} {counts.get(name, 0)}' for rid, counts in caches.items()]
    return lines


def ingress_lines(states: Mapping[str, int], replica_failures: int, requests: Mapping[int, int]) -> list[str]:
    """The ingress's own counts: replicas by Serve state, calls lost with a replica, and requests
    it answered by status (these include the replicas' answers it relayed)."""
    lines = _family_head("foveal_replicas", "gauge", "replicas by Ray Serve state")
    lines += [f'foveal_replicas{{state="{state}"}} {n}' for state, n in sorted(states.items())]
    lines += _family_head(
        "foveal_replica_failures_total", "counter", "calls answered 503 because their replica died"
    )
    lines.append(f"foveal_replica_failures_total {replica_failures}")
    lines += _family_head(
        "foveal_ingress_requests_total", "counter", "requests the ingress answered, by status"
    )
    lines += [f'foveal_ingress_requests_total{{status="{s}"}} {n}' for s, n in sorted(requests.items())]
    return lines


def _family_head(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
