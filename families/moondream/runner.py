"""`MoondreamRunner`: the `ModelRunner` of a Moondream 2 checkpoint, with region heads sampled in the pipeline.

PROBLEM
    The engine launches flat batches mixing prefills (with images) and decode rows; Moondream's
    decode rows may be token steps or region steps, whose input is a coordinate or size encoding
    rather than a token embedding, and whose output is a bin read from a region head.
SOLUTION
    `forward(batch)`: input embeddings are built on the device from the ids: token ids through
    `wte`, region-value ids (>= vocab_size, written by the previous step's sampler) through the
    region encoders (branch-free, region.py); in prefill launches the image placeholder rows
    (positions 1..729 of a sequence with an image) are replaced by the image's embeddings, taken
    from the runner's `ImageFeatureCache` by `image_key` or encoded in that launch (one vision call
    for all misses); a prefill whose first pages came from the prefix cache (kv_cache.prefix_seed)
    takes only the rows its query holds. The decoder runs on the paged KV (text.py); logits of each
    sequence's last token are returned, and their hidden states (before post_ln) kept as
    `last_hidden`, which the engine keeps with the step for its sample job. `sample_regions`
    (called by that job, on the device, after the token sampler) overwrites region rows' sampled
    ids with value ids: a GATE row becomes eos if the token sampler chose eos, else x's coordinate
    id from the same hidden state; a COORD row its y coordinate id; a SIZE row its size id. All
    greedy, as the reference decodes. On CPU, decode launches replay traced graphs (traced.py),
    which return [logits | hidden].
    Besides `ModelRunner`, the runner implements the engine's `regions.RegionHeads` (`last_hidden`,
    `sample_regions`), `regions.RegionLogprobs` (`region_logprobs`: the heads' distributions, what
    region answers are scored from, scores.py) and `runner.Quiesce` (`quiesce`), which the engine
    resolves once, when it is built.
INVARIANTS
    - No host synchronisation in forward or sample_regions (tilings are host ints from the processor).
    - The vision encoder runs only for images missing from the cache (`images_encoded` counts them).
    - Logits are float32 [num_seqs, vocab_size]; `last_hidden` is float32 [num_seqs, dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foveal.engine.models.arch import Architecture
from foveal.engine.models.attention import PagedKV, build_context, kv_zeros, prefix_lens
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES, ImageFeatureCache, cached_or_encoded
from foveal.engine.models.traced import DecodeGraphs
from foveal.engine.request import PrefillInputs
from foveal.engine.runner import ForwardBatch

from . import region
from .answers import COORD, GATE, SIZE, THINK
from .config import HEAD_DIM, MoondreamConfig
from .lora import AdapterBank, VariantBank, selector
from .text import rotary_table
from .weights import MoondreamWeights


class MoondreamRunner:
    def __init__(
        self,
        weights: MoondreamWeights,
        arch: Architecture,
        image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
        trace_decode: bool | None = None,
    ) -> None:
        self.weights = weights.eval().requires_grad_(False)
        self.config: MoondreamConfig = weights.config
        self.arch = arch
        parts = weights.model
        self.vision, self.text, self.region = parts.vision, parts.text, parts.region
        text = self.config.text
        self.vocab_size = text.vocab_size
        self.max_positions: int | None = text.max_context
        self.device = self.text.wte.device
        self.dtype = self.text.wte.dtype
        self.num_layers, self.kv_heads = text.n_layers, text.n_kv_heads
        self.eos_id = self.config.tokenizer.eos_id
        self.cos, self.sin = (t.to(self.device) for t in rotary_table(text.max_context, self.config.rope_theta))
        self.coord_token = self.config.tokenizer.coord_id
        self._head_logits: tuple | None = None  # sample_regions' (rows, coord, size logits), for region_logprobs
        self.image_cache = ImageFeatureCache(image_cache_bytes)
        text_shapes = {
            "qkv": (text.dim, (text.n_heads + 2 * text.n_kv_heads) * HEAD_DIM),
            "proj": (text.dim, text.dim),
            "fc1": (text.dim, text.ff_dim),
            "fc2": (text.ff_dim, text.dim),
        }
        self.variants: VariantBank | AdapterBank = (  # Moondream 3's adapters are another format (lora.py)
            AdapterBank(text, self.device, self.dtype) if self.config.generation == 3
            else VariantBank(text.n_layers, text_shapes, self.device, self.dtype)
        )
        self.page_variant: torch.Tensor | None = None  # [pages + 1]: the variant of the sequence owning a first page
        self.images_encoded = 0
        self.kv: PagedKV | None = None
        self.last_hidden: torch.Tensor | None = None
        if trace_decode is None:
            trace_decode = self.device.type == "cpu"
        self.decode_graphs = DecodeGraphs(self._eager) if trace_decode else None

    # ---- the ModelRunner protocol ---------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * HEAD_DIM * self.dtype.itemsize

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        shape = ((num_pages + 1) * page_size, self.kv_heads, HEAD_DIM)  # + the scratch page
        make = lambda: kv_zeros(shape, self.dtype, self.device)  # noqa: E731
        self.kv = PagedKV(
            [make() for _ in range(self.num_layers)],
            [make() for _ in range(self.num_layers)],
            page_size,
            num_pages,
        )
        self.page_variant = torch.zeros(num_pages + 1, dtype=torch.int64, device=self.device)
        if self.decode_graphs is not None:
            self.decode_graphs.clear()

    def quiesce(self) -> None:
        """Called by Engine.close(): waits for background traces (traced.py); the runner stays usable."""
        if self.decode_graphs is not None:
            self.decode_graphs.wait()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        kv = self.kv
        if kv is None:
            raise RuntimeError("allocate_kv(num_pages, page_size) must be called before forward()")
        lora = self._lora(batch)
        if batch.is_decode and self.decode_graphs is not None and not batch.prefill and lora is None:
            out = self.decode_graphs(batch, kv.k, kv.v, kv.page_size, kv.scratch_page)
        else:
            out = self._eager(batch, kv.k, kv.v, lora)
        self.last_hidden = out[:, self.vocab_size :]
        return out[:, : self.vocab_size]

    # ---- region steps (engine/regions.py) --------------------------------------------------------
    @torch.inference_mode()
    def sample_regions(
        self, hidden: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        """Overwrite `sampled[rows]` with region-value ids read from the region heads (see the docstring)."""
        h = hidden.index_select(0, rows).to(self.dtype)
        kind = kinds.index_select(0, rows)
        token = sampled.index_select(0, rows)
        coord_logits = self.region.coord_logits(h)
        size_logits = self.region.size_logits(h)
        # region_logprobs, called next in the same sample job for these rows, reads the same logits
        self._head_logits = (rows, coord_logits, size_logits)
        coord = region.coord_id(self.vocab_size, coord_logits.argmax(dim=-1))
        wh = size_logits.argmax(dim=-1)
        size = region.size_id(self.vocab_size, wh[:, 0], wh[:, 1])
        gate = torch.where(token == self.eos_id, token, coord)
        think = torch.where(token == self.coord_token, coord, token)
        value = torch.where(kind == GATE, gate, torch.where(kind == SIZE, size, coord))
        value = torch.where(kind == THINK, think, value)
        value = torch.where((kind == GATE) | (kind == COORD) | (kind == SIZE) | (kind == THINK), value, token)
        sampled.index_copy_(0, rows, value)

    @torch.inference_mode()
    def region_logprobs(
        self, hidden: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor, buffers, k: int
    ) -> None:
        """The region rows' logprobs as scores.py's CONTRACT states them: a GATE row's eos (the token
        sampler's log P(eos), read from its record of the row) and coordinates at log((1 - P(eos)) p_x);
        a COORD row's coordinates; a SIZE row's (w, h) pairs at log p_w + log p_h; a THINK row that
        became a coordinate: NaN (reasonings are not scored). Alternatives are value ids, best first."""
        cached_rows, coord_logits, size_logits = self._head_logits  # sample_regions' for these rows
        if cached_rows is not rows:
            raise RuntimeError("region_logprobs must follow sample_regions for the same rows (one sample job)")
        self._head_logits = None
        kind, value = kinds.index_select(0, rows), sampled.index_select(0, rows)
        n, vocab, neg = rows.shape[0], self.vocab_size, float("-inf")
        lp_x = coord_logits.float().log_softmax(dim=-1)  # [n, bins]
        lp_wh = size_logits.float().log_softmax(dim=-1)  # [n, 2, bins]
        text_ids, text_lp = buffers.top_ids.index_select(0, rows)[:, :k], buffers.top_values.index_select(0, rows)[:, :k]
        eos_lp = (
            torch.where(text_ids == self.eos_id, text_lp, neg).amax(dim=1) if k
            else torch.full((n,), neg, device=rows.device)
        )
        eos_lp = torch.where(value == self.eos_id, buffers.chosen.index_select(0, rows), eos_lp)
        going = torch.log1p(-eos_lp.exp().clamp(max=1.0))  # log(1 - P(eos)); -inf when eos was certain
        gate = kind == GATE
        coord_lp = lp_x + torch.where(gate, going, 0.0)[:, None]
        # the sampled value's logprob
        bin_ = (value - vocab).clamp(0, region.COORD_BINS - 1)
        chosen_coord = coord_lp.gather(1, bin_[:, None])[:, 0]
        pair_index = (value - vocab - region.COORD_BINS).clamp(0, region.SIZE_BINS**2 - 1)
        w_bin, h_bin = pair_index // region.SIZE_BINS, pair_index % region.SIZE_BINS
        chosen_size = lp_wh[:, 0].gather(1, w_bin[:, None])[:, 0] + lp_wh[:, 1].gather(1, h_bin[:, None])[:, 0]
        chosen = torch.where(kind == SIZE, chosen_size, chosen_coord)
        chosen = torch.where(gate & (value == self.eos_id), eos_lp, chosen)
        chosen = torch.where((kind == THINK) & (value >= vocab), float("nan"), chosen)
        think_text = (kind == THINK) & (value < vocab)  # a text token of a reasoning: the sampler's record
        chosen = torch.where(think_text, buffers.chosen.index_select(0, rows), chosen)
        buffers.chosen.index_copy_(0, rows, chosen)
        if not k:
            return
        # alternatives: coordinates (a gate's eos first), or the best (w, h) pairs
        top_c, top_c_bins = coord_lp.topk(k, dim=-1)
        ids_c = top_c_bins + vocab
        eos_ids = torch.full((n, 1), self.eos_id, dtype=ids_c.dtype, device=rows.device)
        ids_c = torch.where(gate[:, None], torch.cat([eos_ids, ids_c[:, :-1]], 1), ids_c)
        top_c = torch.where(gate[:, None], torch.cat([eos_lp[:, None], top_c[:, :-1]], 1), top_c)
        w_val, w_idx = lp_wh[:, 0].topk(k, dim=-1)
        h_val, h_idx = lp_wh[:, 1].topk(k, dim=-1)
        pair_val, pair = (w_val[:, :, None] + h_val[:, None, :]).view(n, -1).topk(k, dim=-1)
        pair_w, pair_h = w_idx.gather(1, pair // k), h_idx.gather(1, pair % k)
        ids_s = region.size_id(vocab, pair_w, pair_h)
        size = (kind == SIZE)[:, None]
        ids, values = torch.where(size, ids_s, ids_c), torch.where(size, pair_val, top_c)
        # a gate whose eos ranks below the coordinates: order by value, so the best come first
        values, order = values.sort(dim=-1, descending=True)
        ids = ids.gather(1, order)
        untouched = think_text[:, None]
        values = torch.where(untouched, text_lp, torch.where((kind == THINK)[:, None], neg, values))
        ids = torch.where(untouched, text_ids, ids)
        buffers.top_values[:, :k].index_copy_(0, rows, values)
        buffers.top_ids[:, :k].index_copy_(0, rows, ids)

    # ---- the forward ---------------------------------------------------------------------------
    def _eager(
        self, batch: ForwardBatch, ks: list[torch.Tensor], vs: list[torch.Tensor], lora: tuple | None = None
    ) -> torch.Tensor:
        kv = PagedKV(ks, vs, self.kv.page_size, self.kv.scratch_page)
        ctx = build_context(batch, kv, prefix_lens(batch, self.device), self.dtype)
        x = self.embed(batch.input_ids)
        prompts = [(row, p) for row, p in enumerate(batch.prefill) if p is not None]
        images = [(row, p) for row, p in prompts if p.num_image_tokens]
        if images:
            x = self._scatter_images(x, batch, ctx.query_seq, images)
        if prompts:
            x = self._scatter_values(x, batch, ctx.query_seq, prompts)
        if lora is not None:
            stacks, seq_variant = lora
            token_variant = seq_variant if ctx.query_seq is None else seq_variant[ctx.query_seq]  # None: decode
            lora = (stacks, selector(stacks, token_variant, x.dtype))
        hidden = self.text(x, batch.positions, ctx, self.cos, self.sin, lora)
        last = hidden.index_select(0, batch.query_start[1:].to(torch.int64) - 1)
        return torch.cat([self.text.logits(last).float(), last.float()], dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = F.embedding(ids.clamp(max=self.vocab_size - 1), self.text.wte)
        values, is_value = self.region.embed_values(ids, self.vocab_size, self.dtype)
        return torch.where(is_value[:, None], values, tokens)

    def _scatter_images(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        query_seq: torch.Tensor,
        images: list[tuple[int, PrefillInputs]],
    ) -> torch.Tensor:
        """Rows at positions 1..729 of a sequence with an image take that image's embedding rows. The
        query may start past some of them (pages from the prefix cache): rows are gathered by position."""
        features = torch.cat(self.image_features([p for _, p in images])).to(x.dtype)
        n = self.config.image_tokens
        start = torch.full((batch.num_seqs,), -1, dtype=torch.int64)  # each sequence's first feature row
        start[[row for row, _ in images]] = torch.arange(len(images)) * n
        start = start.to(x.device, non_blocking=True)[query_seq]
        at = (start >= 0) & (batch.positions >= 1) & (batch.positions <= n)
        rows = (start + batch.positions - 1).clamp(0, features.shape[0] - 1)
        return torch.where(at[:, None], features.index_select(0, rows), x)

    def _scatter_values(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        query_seq: torch.Tensor,
        prompts: list[tuple[int, PrefillInputs]],
    ) -> torch.Tensor:
        """Rows at a prompt's region-value positions (processor.py) take the values' encodings; a value
        whose position is not in this launch (its page came from the prefix cache) matches no row."""
        for values, where, encode in (("coords", "coord_pos", self.region.encode_coord),
                                      ("sizes", "size_pos", self.region.encode_size)):
            found = [(row, p.image_tensors[values], p.image_tensors[where])
                     for row, p in prompts if values in p.image_tensors]
            if not found:
                continue
            encoded = encode(torch.cat([v for _, v, _ in found]).to(x.dtype))
            pos = torch.cat([at for _, _, at in found])
            seq = torch.cat([torch.full_like(at, row) for row, _, at in found])
            match = (query_seq[:, None] == seq[None, :]) & (batch.positions[:, None] == pos[None, :])
            # at most one match per row: the matmul copies that value's row exactly
            x = torch.where(match.any(dim=1)[:, None], match.to(x.dtype) @ encoded, x)
        return x

    def _lora(self, batch: ForwardBatch) -> tuple | None:
        """(stacks, [B] variant index of each sequence) when any variant is loaded, else None.

        A sequence's variant is known from its prefill (PrefillInputs "variant") and recorded on its
        first KV page, which only sequences of the same image, values and variant share
        (processor.py keys those pages by the variant); decode rows read it back from there."""
        stacks = self.variants.snapshot
        if stacks is None:
            return None
        first = batch.block_tables[:, 0].to(torch.int64).clamp(min=0)
        # Every Moondream prompt carries PrefillInputs (processor.py), so a None here is a decode row.
        rows = [row for row, p in enumerate(batch.prefill) if p is not None]
        if rows:
            index = [int(batch.prefill[row].image_tensors.get("variant", 0)) for row in rows]
            self.page_variant.index_copy_(
                0, first[rows], torch.tensor(index, dtype=torch.int64).to(self.device, non_blocking=True)
            )
        seq_variant = self.page_variant.index_select(0, first)
        if self.device.type == "cpu" and not bool(seq_variant.any()):
            return None  # the host is the device: a batch of base rows replays the base graphs
        return stacks, seq_variant

    def image_features(self, images: list[PrefillInputs]) -> list[torch.Tensor]:
        """Each image's [729, dim] embeddings: cached ones by key, misses encoded in one call (a key
        seen twice in the launch is encoded once)."""
        return cached_or_encoded(self.image_cache, images, self.encode_images)

    def encode_images(self, images: list[PrefillInputs]) -> list[torch.Tensor]:
        pixels = [image.image_tensors["pixels"] for image in images]
        tilings = [tuple(int(v) for v in image.image_tensors["tiling"].tolist()) for image in images]
        self.images_encoded += len(images)
        return self.vision.embed(pixels, tilings)
