"""`HFRunner`: a `ModelRunner` over a transformers model whose decoder attention is foveal's paged attention.

PROBLEM
    The engine launches flat batches (`ForwardBatch`) that mix sequences, prefill chunks and decode
    tokens, and expects logits of each sequence's last query token. A transformers model expects a
    padded [batch, seq] input and its own cache.

SOLUTION
    Feed the flat batch as one sequence of T tokens ([1, T]) with the batch's own position ids
    (shifted by the family's offset: PaliGemma counts from 1), no transformers cache, and a
    `PagedContext` passed through transformers' kwargs to every decoder attention call
    (`attention.py`), where sequences are separated again. Images of the sequences being prefilled
    are encoded in that launch by the family's own `get_image_features` (misses only: features of
    a `PrefillInputs.image_key` seen before come from the runner's `ImageFeatureCache`, image_cache.py),
    and handed to the forward as `mm_encoder_outputs`, transformers' hook for precomputed encoder
    outputs, so transformers' own code scatters them over the image placeholder tokens in order.
    The last-token rows are selected before the LM head (`logits_to_keep`), so the head runs on B
    rows, not T. Rows of one launch may share pages (a speculative verify step's positions,
    runner.SharedPages): each layer writes the whole launch's K/V before any row attends.

INVARIANTS
    - `forward` before `allocate_kv` raises (tested).
    - Logits are float32, [num_seqs, vocab_size], whatever the compute dtype.
    - Images are encoded only in launches whose `prefill` inputs carry them (prefill), never in decode,
      and an image whose key is cached, or already in the launch, is not encoded again; a hit gives
      the same logits as a miss (tests/models/test_image_cache.py).
    - Cached features must fill exactly the request's image tokens, else the launch raises (a key
      reused for another image can never be scattered silently). Only the rows past the image tokens
      whose K/V the prefix cache held (`PrefillInputs.cached_image_tokens`) are scattered.
    - On CPU, decode launches replay a traced graph per bucket (traced.py) with the same logits.
    - Each decoder layer attends over the KV tensors `kv_layout` names (default: its own, all of one
      shape). A family whose layers differ in KV shape (Gemma 4's full-attention layers: other head
      counts and sizes) or share another layer's K/V overrides `layout_kv`; a sharing layer owns no
      KV tensor and writes none, so `kv_bytes_per_token` counts only the tensors that exist. The
      tensors that only sliding layers of one window read (`KVLayout.windows`) get a page pool of
      their own when the engine asks (`allocate_kv(..., sliding_pages=)`, engine/sliding.py).
    - Launches without images run `LeanDecoder` (lean.py) when the text model's layers are of a
      shape it reproduces (`self.lean` is then set), transformers' forward otherwise; both give the
      same logits (tested per family through greedy parity).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from foveal.engine.models.arch import Architecture
from foveal.engine.models.attention import PagedKV, build_context, kv_zeros, prefix_lens
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES, ImageFeatureCache, cached_or_encoded
from foveal.engine.models.lean import LeanDecoder
from foveal.engine.models.traced import DecodeGraphs
from foveal.engine.request import PrefillInputs
from foveal.engine.runner import ForwardBatch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Which KV tensors each decoder layer attends over, and each tensor's shape per token."""

    index: tuple[int, ...]  # per decoder layer: its KV tensor (a sharing layer: its producer's; -1: none)
    shared: tuple[bool, ...]  # per decoder layer: it reads the producer's K/V and writes none
    shapes: tuple[tuple[int, int], ...]  # per KV tensor: (kv_heads, head_dim)
    # per KV tensor: the sliding window of every layer reading it, or None (a full-attention layer reads it)
    windows: tuple[int | None, ...] | None = None

    def sliding_window(self) -> int | None:
        """The window of the tensors only sliding layers read, when they all share one (sliding.py
        keeps those in a pool of their own); None: no such tensor, or windows of several sizes."""
        found = {w for w in self.windows or () if w is not None}
        return found.pop() if len(found) == 1 else None

    def sliding_tensors(self) -> frozenset[int]:
        window = self.sliding_window()
        return frozenset(i for i, w in enumerate(self.windows or ()) if window is not None and w == window)


class HFRunner:
    """One loaded transformers model, driven one `ForwardBatch` at a time (from a single thread)."""

    rows_share_pages = True  # runner.SharedPages: paged attention writes a launch's K/V before it attends

    def __init__(
        self,
        model: torch.nn.Module,
        arch: Architecture,
        trace_decode: bool | None = None,
        image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
        lean: bool = True,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        # Inference only: no loss is ever computed. Reading the default loss (torch.jit.trace reads
        # every attribute of every submodule) would log transformers' "loss_type=None" warning once.
        # (No module is a PreTrainedModel unless transformers' modeling code was imported: a GGUF
        # model's modules are foveal's, gguf.py, and importing that code costs seconds.)
        modeling = sys.modules.get("transformers.modeling_utils")
        if modeling is not None:
            for module in model.modules():
                if isinstance(module, modeling.PreTrainedModel):
                    module.loss_function = None
        self.arch = arch
        # Touched only from the thread that calls forward (the engine's device thread): no lock.
        self.image_cache = ImageFeatureCache(image_cache_bytes)
        # (torch types a module's attributes Tensor | Module: mypy cannot see a transformers model's config or methods)
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]
        self.vocab_size: int = text.vocab_size
        self.max_positions: int | None = getattr(text, "max_position_embeddings", None)
        self.device: torch.device = next(model.parameters()).device
        self.dtype: torch.dtype = _compute_dtype(model)
        self.num_layers: int = text.num_hidden_layers
        self.kv: PagedKV | None = None
        # Decode launches replay traced graphs on CPU (see traced.py); CUDA runs eager (CUDA graphs: not yet).
        if trace_decode is None:
            trace_decode = self.device.type == "cpu"
        self.decode_graphs = DecodeGraphs(self._eager, self.model) if trace_decode else None
        self.kv_layout: KVLayout = self.layout_kv(model)
        # runner.SlidingWindow: the engine keeps these tensors' pages for each sequence's window only
        self.sliding_window: int | None = self.kv_layout.sliding_window()
        for layer, index, shared in zip(
            model.get_decoder().layers, self.kv_layout.index, self.kv_layout.shared, strict=True  # type: ignore[operator]
        ):
            if index < 0:  # a layer without K/V (a hybrid model's linear attention: the family runs it)
                continue
            layer.self_attn.foveal_kv_index = index
            layer.self_attn.foveal_kv_shared = shared
        # lean=False keeps transformers' forward for every launch (the reference the lean one is tested against).
        self.lean: LeanDecoder | None = LeanDecoder(model) if lean and LeanDecoder.supports(model) else None

    def layout_kv(self, model: torch.nn.Module) -> KVLayout:
        """One KV tensor per decoder layer, all of the text config's shape (families override it)."""
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]  # (as in __init__)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shape = (text.num_key_value_heads, head_dim)
        return KVLayout(tuple(range(self.num_layers)), (False,) * self.num_layers, (shape,) * self.num_layers)

    def kv_bytes_per_token(self) -> int:
        return 2 * sum(heads * dim for heads, dim in self.kv_layout.shapes) * self.dtype.itemsize

    def sliding_kv_bytes_per_token(self) -> int:
        """The share of `kv_bytes_per_token` in tensors only sliding layers read (runner.SlidingWindow)."""
        shapes = self.kv_layout.shapes
        return 2 * sum(shapes[i][0] * shapes[i][1] for i in self.kv_layout.sliding_tensors()) * self.dtype.itemsize

    def allocate_kv(self, num_pages: int, page_size: int, sliding_pages: int | None = None) -> None:
        """KV tensors of `num_pages` pages (+ a scratch page); with `sliding_pages`, the sliding-only
        tensors (runner.SlidingWindow) get that many pages of their own pool instead."""
        sliding = self.kv_layout.sliding_tensors() if sliding_pages is not None else frozenset()

        def make(index: int) -> torch.Tensor:
            pages = sliding_pages if index in sliding else num_pages
            assert pages is not None  # `sliding` is empty without sliding_pages
            heads, dim = self.kv_layout.shapes[index]
            return kv_zeros(((pages + 1) * page_size, heads, dim), self.dtype, self.device)

        tensors = range(len(self.kv_layout.shapes))
        self.kv = PagedKV(
            k=[make(i) for i in tensors],
            v=[make(i) for i in tensors],
            page_size=page_size,
            scratch_page=num_pages,
            sliding=sliding,
            window=self.sliding_window if sliding else None,
            sliding_scratch_page=sliding_pages if sliding and sliding_pages is not None else -1,
        )
        if self.decode_graphs is not None:
            self.decode_graphs.clear()  # traces hold the old KV tensors' shapes

    def quiesce(self) -> None:
        """Called by Engine.close(): waits for background traces (traced.py); the runner stays usable."""
        if self.decode_graphs is not None:
            self.decode_graphs.wait()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        kv = self.kv
        if kv is None:
            raise RuntimeError("allocate_kv(num_pages, page_size) must be called before forward()")
        if batch.is_decode and self.decode_graphs is not None and not batch.prefill:
            return self.decode_graphs(batch, kv.k, kv.v, kv.page_size, kv.scratch_page, kv.sliding_scratch_page)
        return self._eager(batch, kv.k, kv.v)

    def _eager(self, batch: ForwardBatch, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        assert self.kv is not None  # allocate_kv ran (forward checks it)
        kv = replace(self.kv, k=ks, v=vs)  # the traced graphs pass the KV tensors as inputs
        prefix = prefix_lens(batch, self.device) if self.arch.prefix_attention else None
        context = build_context(batch, kv, prefix, self.dtype, self.attention_blocks(batch))
        # images whose tokens the prefix cache held entirely need no features (nor an encoder run)
        images = [p for p in batch.prefill if p is not None and p.num_image_tokens > p.cached_image_tokens]
        # A decode launch has one query token per sequence: every row is a last row.
        last = None if batch.is_decode else batch.query_start[1:].to(torch.int64) - 1
        if self.lean is not None and not images:
            return self.lean(batch.input_ids, self.position_ids(batch)[0], last, context)
        out = self.model(
            input_ids=batch.input_ids[None],
            position_ids=self.position_ids(batch),
            use_cache=False,
            logits_to_keep=batch.query_start[1:].to(torch.int64) - 1,
            foveal_context=context,
            **self._image_inputs(images),
        )
        return out.logits[0].float()

    def attention_blocks(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[T] bool: the launch's tokens that attend bidirectionally within their sequence (build_context's
        `blocks`); None: causal. Families whose image tokens see each other override it."""
        return None

    def position_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's `position_ids`: [1, T], the batch's positions shifted by the family's offset.
        Families with multimodal positions override it (qwen_vl.py: M-RoPE, [3, 1, T])."""
        return (batch.positions + self.arch.position_offset)[None]

    def _image_inputs(self, images: list[PrefillInputs]) -> dict[str, Any]:
        """`mm_encoder_outputs` for the launch's images in sequence order: cached features, misses encoded at once.

        A key seen twice in one launch (the same image in concurrent calls) is encoded once.
        """
        if not images:
            return {}
        features = cached_or_encoded(self.image_cache, images, self.encode_images)
        for image, feats in zip(images, features, strict=True):
            if feats.shape[0] != image.num_image_tokens:
                raise ValueError(
                    f"image features of key {image.image_key!r} have {feats.shape[0]} rows but the prompt has "
                    f"{image.num_image_tokens} image tokens; an image_key must identify one image's pixels"
                )
        # features only for the image tokens in this launch's queries (past those the prefix cache held)
        joined = torch.cat([feats[image.cached_image_tokens :] for image, feats in zip(images, features, strict=True)])
        pooled = [joined] if self.arch.features_as_list else joined
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # typed Tensor | None, but the models of features_as_list families read a list there
        return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=pooled)}}  # type: ignore[arg-type]

    def encode_images(self, images: list[PrefillInputs]) -> list[torch.Tensor]:
        """The family's image features of each request's image, [image tokens, hidden], in one encoder call."""
        # get_image_features: as in __init__, mypy cannot see a transformers model's methods
        pooled = self.model.get_image_features(**self.arch.image_kwargs(images)).pooler_output  # type: ignore[operator]
        if isinstance(pooled, (list, tuple)):
            flat = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
        else:
            flat = pooled.reshape(-1, pooled.shape[-1])
        return list(flat.split([image.num_image_tokens for image in images]))


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype activations run in: the first floating parameter's or buffer's (quantized layers hold int8/uint8)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32
