"""Qwen3.5 (image-text, hybrid attention) on foveal's engine: load-time checks and the runner.

PROBLEM
    Qwen3.5's decoder interleaves Gated DeltaNet linear-attention layers (a per-sequence conv and
    recurrent state, no K/V) with full-attention layers (K/V, M-RoPE positions as Qwen3-VL's); its
    vision tower and processor are Qwen3-VL's.
SOLUTION
    `Qwen35Runner` is QwenVLRunner (M-RoPE positions, Qwen-VL's image features) whose paged KV holds
    the full-attention layers only (`layout_kv`: the linear layers get none) and whose linear layers
    run `engine.models.recurrent.paged_linear_attention` from a `RecurrentStates` store of one state
    row per KV page (snapshots at page boundaries: the prefix cache shares them with the pages,
    recurrent.py says how). Decode launches run eager (no traced graphs: the per-piece state
    bookkeeping reads host values), and LeanDecoder never applies (its layers are Llama-style).
INVARIANTS
    - `kv_bytes_per_token` counts the full-attention layers' K/V and each token's share of its page's
      state row, so a KV budget covers both.
    - A folder without vision_config, image_token_id, layer_types naming both kinds, or a tensor, is
      refused at load, naming what is missing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from foveal.engine.kv_cache import DEFAULT_PAGE_SIZE
from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES
from foveal.engine.models.recurrent import RecurrentStates, paged_linear_attention
from foveal.engine.models.runner import KVLayout
from foveal.engine.runner import ForwardBatch
from foveal.families.qwen_vl.model import QwenVLRunner

LINEAR, FULL = "linear_attention", "full_attention"


def check_hybrid(raw: Mapping[str, Any], path: Path) -> None:
    """Refuse a config whose layer kinds this runner does not know (before any weights are read)."""
    text = raw.get("text_config") or {}
    kinds = set(text.get("layer_types") or ())
    if not kinds or not kinds <= {LINEAR, FULL}:
        raise ModelLoadError(
            f"{path}: the text config's layer_types {sorted(kinds)} are not Qwen3.5's "
            f"('{LINEAR}' and '{FULL}'); save the checkpoint's own config.json"
        )


class Qwen35Runner(QwenVLRunner):
    """QwenVLRunner with Qwen3.5's linear-attention layers on per-sequence recurrent states (module docstring)."""

    def __init__(
        self, model: torch.nn.Module, arch: Architecture, image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES, **_: Any
    ) -> None:
        super().__init__(model, arch, image_cache_bytes=image_cache_bytes, trace_decode=False)
        self.linear = {
            index: layer.linear_attn
            for index, layer in enumerate(model.get_decoder().layers)  # type: ignore[operator]  # nn.Module: Tensor | Module
            if getattr(layer, "linear_attn", None) is not None
        }
        self.states: RecurrentStates | None = None
        self._launch_states = threading.local()
        for module in self.linear.values():
            module.forward = self._linear_forward(module)

    def layout_kv(self, model: torch.nn.Module) -> KVLayout:
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]  # (as above)
        shapes: list[tuple[int, int]]
        index, shapes = [], []
        for kind in text.layer_types:
            index.append(len(shapes) if kind == FULL else -1)
            if kind == FULL:
                shapes.append((text.num_key_value_heads, text.head_dim))
        return KVLayout(tuple(index), (False,) * len(index), tuple(shapes))

    def kv_bytes_per_token(self) -> int:
        # a page's state row is shared by its page_size tokens; the engine's default page size is the
        # smallest share counted here (an engine with larger pages over-counts, never under-counts)
        state = RecurrentStates.bytes_per_row(self.linear, self.dtype)
        return super().kv_bytes_per_token() + -(-state // DEFAULT_PAGE_SIZE)

    # no sliding_pages: the engine passes it only to a runner with a sliding window, which this is not
    def allocate_kv(self, num_pages: int, page_size: int) -> None:  # type: ignore[override]
        super().allocate_kv(num_pages, page_size)
        self.states = RecurrentStates(self.linear, num_pages + 1, page_size, self.dtype, self.device)

    def _eager(self, batch: ForwardBatch, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        assert self.states is not None  # allocate_kv ran (forward checks it)
        self._launch_states.launch = self.states.launch(batch)
        try:
            return super()._eager(batch, ks, vs)
        finally:
            self._launch_states.launch = None

    def _linear_forward(self, module: Any):
        def forward(hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any):
            launch = getattr(self._launch_states, "launch", None)
            if launch is None:
                raise RuntimeError("a linear-attention layer ran outside a runner launch")
            assert self.states is not None  # a launch made from them
            return paged_linear_attention(module, hidden_states, launch, self.states, modeling_qwen3_5)

        return forward
