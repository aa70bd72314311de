"""Moondream's region heads: Fourier features, coordinate and size encoders and decoders.

A detect / point answer is not text. After the prompt, the decoder's hidden state (before the final
LayerNorm) is read by `coord_decoder` (1024 bins, value = bin / 1024) and `size_decoder` (2 x 1024
log-scale bins, size = 2^(bin / 1023 * 10 - 10)); Moondream 2's decoders are MLPs, Moondream 3's one
Linear each, and later Moondream 3 checkpoints put a LayerNorm `ln` before both (`coord_logits`,
`size_logits` apply whichever the checkpoint has); the value chosen is fed back to the decoder as
`coord_encoder(fourier(x))` or `size_encoder(fourier([w, h]))` in place of a token embedding.
fourier(v) = [cos(2 pi v F), sin(2 pi v F)] with F the learned `coord_features` [1, n] or
`size_features` [2, n].

Value ids: so that region values travel through the engine like tokens (sampled on the device,
copied to the host, committed, fed back on the device), each value has an id past the text
vocabulary V: a coordinate bin b is V + b, a size (w_bin, h_bin) is V + 1024 + w_bin * 1024 + h_bin.
`embed_values` turns such ids into input embeddings on the device; `value_of` reads them on the host.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import LN_EPS, RegionConfig
from .layers import MLP

COORD_BINS = 1024
SIZE_BINS = 1024


def coord_id(vocab_size: int, bin_: torch.Tensor | int) -> torch.Tensor | int:
    return vocab_size + bin_


def size_id(vocab_size: int, w_bin: torch.Tensor | int, h_bin: torch.Tensor | int) -> torch.Tensor | int:
    return vocab_size + COORD_BINS + w_bin * SIZE_BINS + h_bin


def value_of(vocab_size: int, value_id: int) -> tuple[str, tuple[int, ...]]:
    """("token", (id,)), ("coord", (bin,)) or ("size", (w_bin, h_bin)) of an id the engine committed."""
    if value_id < vocab_size:
        return "token", (value_id,)
    offset = value_id - vocab_size
    if offset < COORD_BINS:
        return "coord", (offset,)
    offset -= COORD_BINS
    if offset < SIZE_BINS * SIZE_BINS:
        return "size", divmod(offset, SIZE_BINS)
    raise ValueError(f"id {value_id} is neither a token nor a region value (vocabulary {vocab_size})")


def size_from_bins(bins: torch.Tensor) -> torch.Tensor:
    """Log-scale size bins -> sizes in float32, as the reference computes them: 2^(bin/1023*10 - 10)."""
    return torch.pow(2.0, (bins.float() / 1023.0) * 10.0 - 10.0)


def coord_from_bin(bins: torch.Tensor) -> torch.Tensor:
    return bins.float() / COORD_BINS


def fourier(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * x @ freqs
    return torch.cat([f.cos(), f.sin()], dim=-1)


class RegionHeads(nn.Module):
    def __init__(self, cfg: RegionConfig, **factory) -> None:
        super().__init__()
        self.coord_features = nn.Parameter(torch.empty(1, cfg.coord_feat_dim // 2, **factory))
        self.coord_encoder = nn.Linear(cfg.coord_feat_dim, cfg.dim, **factory)
        self.coord_decoder = _decoder(cfg, cfg.coord_out_dim, **factory)
        self.size_features = nn.Parameter(torch.empty(2, cfg.size_feat_dim // 2, **factory))
        self.size_encoder = nn.Linear(cfg.size_feat_dim, cfg.dim, **factory)
        self.size_decoder = _decoder(cfg, cfg.size_out_dim, **factory)
        self.ln = nn.LayerNorm(cfg.dim, eps=LN_EPS, **factory) if cfg.ln else None

    def _decoder_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.ln is None else self.ln(hidden)

    def coord_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, dim] hidden states (before post_ln) -> [N, 1024] coordinate bin logits."""
        return self.coord_decoder(self._decoder_input(hidden))

    def size_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, dim] -> [N, 2, 1024] log-size bin logits (row 0 width, row 1 height)."""
        return self.size_decoder(self._decoder_input(hidden)).view(hidden.shape[0], 2, -1)

    def encode_coord(self, coord: torch.Tensor) -> torch.Tensor:
        """[N] coordinates (in the model dtype, as the reference casts them) -> [N, dim]."""
        return self.coord_encoder(fourier(coord[:, None], self.coord_features))

    def encode_size(self, size: torch.Tensor) -> torch.Tensor:
        """[N, 2] (w, h) -> [N, dim]."""
        return self.size_encoder(fourier(size, self.size_features))

    def embed_values(
        self, ids: torch.Tensor, vocab_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of region-value ids (branch-free, so that a traced decode step takes them too):
        returns ([T, dim] embeddings, [T] bool: id is a region value). Rows that are tokens get junk."""
        offset = (ids - vocab_size).clamp(min=0)
        is_coord = (ids >= vocab_size) & (offset < COORD_BINS)
        is_value = ids >= vocab_size
        coord = coord_from_bin(offset.clamp(max=COORD_BINS - 1)).to(dtype)
        size_offset = (offset - COORD_BINS).clamp(min=0)
        wh = torch.stack([size_offset // SIZE_BINS, size_offset % SIZE_BINS], dim=-1)
        size = size_from_bins(wh).to(dtype)
        coords, sizes = self.encode_coord(coord), self.encode_size(size)
        return torch.where(is_coord[:, None], coords, sizes), is_value


def _decoder(cfg: RegionConfig, out: int, **factory) -> nn.Module:
    """Moondream 2's MLP decoder, or Moondream 3's single Linear (inner_dim None)."""
    if cfg.inner_dim is None:
        return nn.Linear(cfg.dim, out, **factory)
    return MLP(cfg.dim, cfg.inner_dim, out, **factory)
