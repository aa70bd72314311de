"""`ImageFeatureCache`: a per-runner LRU of image features, keyed by the image's content hash, bounded in bytes.

PROBLEM
    Several calls on one image (detect, then point, then a caption) each run the vision tower on the
    same pixels, the largest single cost of an image prefill on small models. PaliGemma's prefix
    attention makes the prompt's KV depend on the prompt's text, so that KV cannot be reused across
    prompts; the image features (what the model scatters over its image placeholder tokens) can.

SOLUTION
    The runner looks each prefill image up by `PrefillInputs.image_key` (the SDK's content hash of the
    decoded image) and encodes only the misses. Entries are the family's features for one image,
    [image tokens, hidden], on the model's device, in its dtype. Least recently used entries are
    evicted once the stored bytes would exceed `max_bytes`; `max_bytes=0` turns the cache off.

INVARIANTS (tests/models/test_image_cache.py)
    - Stored bytes never exceed `max_bytes`; an entry larger than the bound is not stored.
    - Eviction is least recently used first: a `get` hit refreshes its entry.
    - One key, one entry: different keys never share features.
    - Touched only from the runner's thread (the engine's device thread), so it takes no lock;
      `resize` from another thread only while no request is in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from foveal.engine.request import PrefillInputs

DEFAULT_IMAGE_CACHE_BYTES = 64 * 2**20


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ImageFeatureCache:
    """LRU map image_key -> features tensor, at most `max_bytes` of tensor data."""

    def __init__(self, max_bytes: int = DEFAULT_IMAGE_CACHE_BYTES) -> None:
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.stats = CacheStats()
        self.max_bytes = 0
        self.resize(max_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The features stored under `key` (now the most recently used), or None; counts a hit or a miss."""
        features = self._entries.get(key)
        if features is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return features

    def put(self, key: str, features: torch.Tensor) -> None:
        """Store `features` under `key`, evicting least recently used entries to stay within `max_bytes`."""
        size = _nbytes(features)
        if size > self.max_bytes:
            return  # would evict everything and still not fit (and max_bytes=0 means off)
        if key in self._entries:
            self.bytes -= _nbytes(self._entries.pop(key))
        self._evict_to(self.max_bytes - size)
        self._entries[key] = features
        self.bytes += size

    def resize(self, max_bytes: int) -> None:
        """Change the bound (0 turns the cache off), evicting down to it."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(
                f"image cache size must be a byte count >= 0 (0 turns it off), got {max_bytes!r}"
            )
        self.max_bytes = max_bytes
        self._evict_to(max_bytes)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _evict_to(self, limit: int) -> None:
        while self._entries and self.bytes > limit:
            _, features = self._entries.popitem(last=False)
            self.bytes -= _nbytes(features)
            self.stats.evictions += 1


def cached_or_encoded(
    cache: ImageFeatureCache,
    images: list[PrefillInputs],
    encode: Callable[[list[PrefillInputs]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Each image's features in order: cached ones by `image_key`, the misses encoded in one `encode`
    call and stored. A key seen twice in the list (the same image in concurrent calls) is encoded once."""
    sources: list[torch.Tensor | int] = []  # per image: its cached features, or its index in to_encode
    to_encode: list[PrefillInputs] = []
    first: dict[str, int] = {}  # key -> index in to_encode, for keys missed earlier in the list
    for image in images:
        key = image.image_key
        cached = None if key is None or key in first else cache.get(key)
        if cached is not None:
            sources.append(cached)
        elif key is not None and key in first:
            sources.append(first[key])
        else:
            if key is not None:
                first[key] = len(to_encode)
            sources.append(len(to_encode))
            to_encode.append(image)
    encoded = encode(to_encode) if to_encode else []
    for image, features in zip(to_encode, encoded, strict=True):
        if image.image_key is not None:
            cache.put(image.image_key, features.clone())  # a copy: a view would pin the whole batch
    return [encoded[s] if isinstance(s, int) else s for s in sources]


def _nbytes(features: torch.Tensor) -> int:
    return features.numel() * features.element_size()
