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
    are passed once, in that launch, as the family's image kwargs; transformers' own code encodes
    them and scatters the features over the image placeholder tokens in order. The last-token rows
    are selected before the LM head (`logits_to_keep`), so the head runs on B rows, not T.

INVARIANTS
    - `forward` before `allocate_kv` raises (tested).
    - Logits are float32, [num_seqs, vocab_size], whatever the compute dtype.
    - Images are encoded only in launches whose `extras` carry them (prefill), never in decode.
    - On CPU, decode launches replay a traced graph per bucket (traced.py) with the same logits.
"""

from __future__ import annotations

import torch

from foveal.engine.models.attention import PagedKV, build_context
from foveal.engine.models.families import Family
from foveal.engine.models.traced import DecodeGraphs
from foveal.engine.runner import ForwardBatch


class HFRunner:
    """One loaded transformers model, driven one `ForwardBatch` at a time (from a single thread)."""

    def __init__(self, model: torch.nn.Module, family: Family, trace_decode: bool | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.family = family
        text = model.config.get_text_config()
        self.vocab_size: int = text.vocab_size
        self.device: torch.device = next(model.parameters()).device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.num_layers: int = text.num_hidden_layers
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.kv: PagedKV | None = None
        # Decode launches replay traced graphs on CPU (see traced.py); CUDA runs eager (CUDA graphs: not yet).
        if trace_decode is None:
            trace_decode = self.device.type == "cpu"
        self.decode_graphs = DecodeGraphs(self._eager) if trace_decode else None
        for index, layer in enumerate(model.get_decoder().layers):
            layer.self_attn.foveal_kv_index = index

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        shape = ((num_pages + 1) * page_size, self.kv_heads, self.head_dim)  # + the scratch page
        make = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        self.kv = PagedKV(
            k=[make() for _ in range(self.num_layers)],
            v=[make() for _ in range(self.num_layers)],
            page_size=page_size,
            scratch_page=num_pages,
        )
        if self.decode_graphs is not None:
            self.decode_graphs.graphs.clear()  # traces hold the old KV tensors' shapes

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        kv = self.kv
        if kv is None:
            raise RuntimeError("allocate_kv(num_pages, page_size) must be called before forward()")
        if batch.is_decode and self.decode_graphs is not None and all(e is None for e in batch.extras):
            return self.decode_graphs(batch, kv.k, kv.v, kv.page_size, kv.scratch_page)
        return self._eager(batch, kv.k, kv.v)

    def _eager(self, batch: ForwardBatch, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        kv = PagedKV(ks, vs, self.kv.page_size, self.kv.scratch_page)
        prefix_lens = self._prefix_lens(batch) if self.family.prefix_attention else None
        context = build_context(batch, kv, prefix_lens)
        image_kwargs = self.family.image_kwargs([e for e in batch.extras if e is not None])
        out = self.model(
            input_ids=batch.input_ids[None],
            position_ids=(batch.positions + self.family.position_offset)[None],
            use_cache=False,
            logits_to_keep=batch.query_start[1:].to(torch.int64) - 1,
            foveal_context=context,
            **image_kwargs,
        )
        return out.logits[0].float()

    def _prefix_lens(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Per sequence, the bidirectional prefix length (0 for sequences in decode: their prefix is cached)."""
        if batch.is_decode or not batch.extras:
            return None
        lens = [0 if e is None else e.get("prefix_len", 0) for e in batch.extras]
        return torch.tensor(lens, dtype=torch.int64).to(self.device, non_blocking=True)
