"""`MoondreamProcessor`: a Moondream prompt (+ image) -> prompt ids and `PrefillInputs`.

Moondream's prompts are token ids, not text: template ids (from the config) around the user's text,
which is tokenized on its own (`MoondreamPrompt`). A prompt may also hold region values in place of
tokens (`Coord`, `Size`: spatial references, detect_gaze's eye, a reasoning's coordinates fed back):
their ids are the coord / size token ids, and the prefill launch replaces those rows' embeddings by
the values' encodings (`coord_encoder(fourier(x))`, `size_encoder(fourier([w, h]))`), as the
reference does (the values travel as `PrefillInputs.image_tensors` "coords" / "sizes" with their
absolute positions, so a prefill that starts past them, from the prefix cache, skips them).
With an image the prompt is BOS, 729 placeholder ids (their embeddings are replaced by the image's
rows in the prefill launch), then the template; BOS and the image rows are the bidirectional prefix
(`prefix_len` 730). Without an image it is BOS then the template, causal from position 0.

The prefix cache keys pages by the image key and the token ids (kv_cache.prefix_seed). What neither
says about the K/V, the region values and the LoRA variant (whose delta applies to the image prefix
too), is the prompt's `PrefillInputs.cache_salt`, a digest of them: such pages are shared only
between prompts with the same image, values and variant, text-only prompts included. The image key
itself stays the image's, so the runner's image-embedding cache is shared across values and variants.
The crops are cut and normalized here, on the caller's thread (PIL resizes are the slow part),
and moved to the runner's device and dtype; the tiling travels as a CPU tensor (the runner needs
it as host ints to stitch, and must not read the device for it).
INVARIANTS
    - A prompt with region values or a variant carries a cache salt, with an image or without.
    - The salt is derived from the values and the variant themselves, never given.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from foveal.engine.models.processor import PromptInputs, to_pil
from foveal.engine.request import PrefillInputs

from . import vision
from .config import MoondreamConfig


@dataclass(frozen=True, slots=True)
class Coord:
    """A coordinate fed as `coord_encoder(fourier(value))` at a coord-token position."""

    value: float


@dataclass(frozen=True, slots=True)
class Size:
    """A (w, h) size fed as `size_encoder(fourier([w, h]))` at a size-token position."""

    w: float
    h: float


Part = int | str | Coord | Size  # a template id, text (tokenized as given), or a region value


@dataclass(frozen=True, slots=True)
class MoondreamPrompt:
    """Template parts around the user's text; `text` is tokenized without special tokens, as given
    (the skill adds the leading space where the reference does). `variant`: a LoRA variant's index
    in the runner's bank (lora.py), 0 for none."""

    prefix: tuple[Part, ...]
    text: str = ""
    suffix: tuple[Part, ...] = ()
    variant: int = 0
    variant_name: str | None = None  # what the key is salted with (the variant's identity)

    def __str__(self) -> str:
        return f"{list(self.prefix)} {self.text!r} {list(self.suffix)}"


class MoondreamProcessor:
    def __init__(
        self, config: MoondreamConfig, tokenizer: Any, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype

    def ids(self, prompt: MoondreamPrompt) -> list[int]:
        """The template's ids with the text's ids between them (no BOS, no image)."""
        return self.ids_and_values(prompt)[0]

    def ids_and_values(self, prompt: MoondreamPrompt) -> tuple[list[int], list[tuple[int, Coord | Size]]]:
        """The prompt's ids (no BOS, no image) and its region values with their offsets in those ids."""
        if not isinstance(prompt, MoondreamPrompt):
            raise TypeError(f"a Moondream prompt is a MoondreamPrompt, not {type(prompt).__name__}")
        ids: list[int] = []
        values: list[tuple[int, Coord | Size]] = []
        for part in (*prompt.prefix, prompt.text, *prompt.suffix):
            if isinstance(part, str):
                ids += self.tokenizer(part, add_special_tokens=False)["input_ids"] if part else []
            elif isinstance(part, Coord | Size):
                values.append((len(ids), part))
                ids.append(self.config.tokenizer.coord_id if isinstance(part, Coord) else self.config.tokenizer.size_id)
            else:
                ids.append(int(part))
        return ids, values

    def __call__(
        self, prompt: MoondreamPrompt, image: Any = None, image_key: str | None = None
    ) -> PromptInputs:
        bos = self.config.tokenizer.bos_id
        ids, values = self.ids_and_values(prompt)
        cache_salt = salt(values, prompt.variant_name) if values or prompt.variant else None
        tensors: dict[str, torch.Tensor] = {"variant": torch.tensor(prompt.variant)} if prompt.variant else {}
        if image is None:
            # Inputs even when empty, not None: the runner tells a prompt's prefill rows from decode
            # rows by them (lora.py's per-sequence variant). The template starts after BOS.
            tensors.update(self._values(values, 1))
            return PromptInputs([bos, *ids], PrefillInputs(tensors, cache_salt=cache_salt))
        v = self.config.vision
        crops, tiling = vision.crops(to_pil(image), v.max_crops, v.overlap_margin)
        pixels = vision.normalize(crops).to(self.device, self.dtype)
        tensors.update({"pixels": pixels, "tiling": torch.tensor(tiling)})
        tensors.update(self._values(values, self.config.prefix_len))  # after BOS + the image rows
        n = self.config.image_tokens
        # The prefix cache keys the pages by the image and the bidirectional prefix (BOS + image:
        # the same ids for every image), so calls on one image share them (kv_cache.prefix_seed). The
        # placeholders are BOS ids; the runner places image rows by position, so it has no use for
        # the engine's count of cached placeholders (`cached_image_tokens`, which counts BOS too).
        prefill = PrefillInputs(
            tensors, n, image_key, self.config.prefix_len, image_token_id=bos, cache_salt=cache_salt
        )
        return PromptInputs([bos, *([bos] * n), *ids], prefill)

    def _values(self, values: list[tuple[int, Coord | Size]], start: int) -> dict[str, torch.Tensor]:
        coords = [(start + at, v.value) for at, v in values if isinstance(v, Coord)]
        sizes = [(start + at, (v.w, v.h)) for at, v in values if isinstance(v, Size)]
        out: dict[str, torch.Tensor] = {}
        if coords:  # float32 first, as the reference builds them, then the model dtype at encode
            out["coords"] = torch.tensor([c for _, c in coords], dtype=torch.float32, device=self.device)
            out["coord_pos"] = torch.tensor([p for p, _ in coords], dtype=torch.int64, device=self.device)
        if sizes:
            out["sizes"] = torch.tensor([s for _, s in sizes], dtype=torch.float32, device=self.device)
            out["size_pos"] = torch.tensor([p for p, _ in sizes], dtype=torch.int64, device=self.device)
        return out


def salt(values: list[tuple[int, Coord | Size]], variant: str | None) -> str:
    """A digest of a prompt's region values (their float32 bits) and variant: its cache salt."""
    digest = hashlib.blake2b(digest_size=16)
    for at, value in values:
        numbers = (value.value,) if isinstance(value, Coord) else (value.w, value.h)
        digest.update(f"{at}:{type(value).__name__}:".encode())
        digest.update(torch.tensor(numbers, dtype=torch.float32).numpy().tobytes())
    digest.update(f"|variant={variant or ''}".encode())
    return digest.hexdigest()
