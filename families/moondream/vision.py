"""Moondream's vision side: overlap tiling, exact preprocessing, the encoder, tile stitching, projection.

PROBLEM
    An image of any size must become 729 embeddings in the text model's space exactly as the
    reference makes them, or every later figure drifts: the crop pixels (PIL LANCZOS resizes), the
    pixel normalization (the reference normalizes in bfloat16, which moves the embeddings by ~0.014
    against float32), the order of crops, and how the tiles' features are stitched and pooled.
SOLUTION
    `crops(image)` (host, on the caller's thread): tiling (th, tw) from the image size, a global
    crop (the whole image resized to 378x378) and th x tw overlapping 378x378 tiles of the image
    resized to (tw*266 + 112) x (th*266 + 112); uint8. `normalize` maps uint8 through a 256-entry
    table of the bf16 chain bf16(bf16(bf16(u)/255) - 0.5)/0.5, so the values are exact in any dtype.
    `VisionEncoder.embed(crops, tiling)` (device): patches -> 27 pre-norm blocks -> post_ln per crop;
    tile features stitched into one grid (each tile's inner part, outer borders kept), adaptive
    average pooling to 27x27, then proj_mlp([global, pooled]) -> [729, text dim].
INVARIANTS
    - Crop order: global, then tiles row-major; for tiling (1, 1) the tile equals the global crop.
    - Patch index = row * 27 + col; a patch is flattened (channel, y, x), 588 values.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from .config import CROP_SIZE, LN_EPS, PATCH_SIZE, VisionConfig
from .layers import MLP, QKV

GRID = CROP_SIZE // PATCH_SIZE  # 27


def tiling(height: int, width: int, max_crops: int = 12, overlap_margin: int = 4) -> tuple[int, int]:
    """(rows, cols) of tiles for an image of this size (the reference's rule)."""
    margin = overlap_margin * PATCH_SIZE
    window = CROP_SIZE - 2 * margin
    h, w = height - 2 * margin, width - 2 * margin
    if h <= window or w <= window:
        return 1, 1
    min_h, min_w = math.ceil(h / window), math.ceil(w / window)
    if min_h * min_w > max_crops:
        scale = math.sqrt(max_crops / (min_h * min_w))
        return max(1, math.floor(min_h * scale)), max(1, math.floor(min_w * scale))
    th = max(math.floor(math.sqrt(max_crops * h / w)), min_h)
    tw = max(math.floor(math.sqrt(max_crops * w / h)), min_w)
    if th * tw > max_crops:
        if tw > th:
            tw = math.floor(max_crops / th)
        else:
            th = math.floor(max_crops / tw)
    return max(1, th), max(1, tw)


def crops(
    image: Image.Image, max_crops: int = 12, overlap_margin: int = 4
) -> tuple[np.ndarray, tuple[int, int]]:
    """[1 + th*tw, 378, 378, 3] uint8 crops (global first, then tiles row-major) and the tiling."""
    image = image.convert("RGB")
    th, tw = tiling(image.height, image.width, max_crops, overlap_margin)
    margin = overlap_margin * PATCH_SIZE
    window = CROP_SIZE - 2 * margin
    lanczos = Image.Resampling.LANCZOS
    out = np.zeros((1 + th * tw, CROP_SIZE, CROP_SIZE, 3), dtype=np.uint8)
    out[0] = np.asarray(image.resize((CROP_SIZE, CROP_SIZE), lanczos))
    tiles = np.asarray(image.resize((tw * window + 2 * margin, th * window + 2 * margin), lanczos))
    for i in range(th):
        for j in range(tw):
            part = tiles[i * window : i * window + CROP_SIZE, j * window : j * window + CROP_SIZE]
            out[1 + i * tw + j, : part.shape[0], : part.shape[1]] = part  # zero padding past an edge
    return out, (th, tw)


def pixel_table() -> torch.Tensor:
    """[256] float32: each uint8 value normalized as the reference does, every step rounded to bfloat16."""
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    u = bf16(torch.arange(256, dtype=torch.float32))
    return bf16(bf16(bf16(u / 255.0) - 0.5) / 0.5)


_TABLE = pixel_table()


def normalize(crops_u8: np.ndarray) -> torch.Tensor:
    """[n, 378, 378, 3] uint8 -> [n, 3, 378, 378] float32 (values exact in bf16 as well)."""
    index = torch.from_numpy(np.ascontiguousarray(crops_u8)).long()
    return _TABLE[index].permute(0, 3, 1, 2).contiguous()


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, **factory) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.enc_dim, eps=LN_EPS, **factory)
        self.attn = QKV(cfg.enc_dim, 3 * cfg.enc_dim, **factory)
        self.ln2 = nn.LayerNorm(cfg.enc_dim, eps=LN_EPS, **factory)
        self.mlp = MLP(cfg.enc_dim, cfg.enc_ff_dim, **factory)
        self.n_heads = cfg.enc_n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        qkv = self.attn.qkv(self.ln1(x)).view(n, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [n, heads, t, head_dim]; heads are contiguous slices
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + self.attn.proj(a)
        return x + self.mlp(self.ln2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, **factory) -> None:
        super().__init__()
        self.cfg = cfg
        patch_dim = cfg.in_channels * PATCH_SIZE * PATCH_SIZE
        self.patch_emb = nn.Linear(patch_dim, cfg.enc_dim, **factory)
        self.pos_emb = nn.Parameter(torch.empty(1, GRID * GRID, cfg.enc_dim, **factory))
        self.blocks = nn.ModuleList(VisionBlock(cfg, **factory) for _ in range(cfg.enc_n_layers))
        self.post_ln = nn.LayerNorm(cfg.enc_dim, eps=LN_EPS, **factory)
        self.proj_mlp = MLP(2 * cfg.enc_dim, cfg.proj_inner_dim, cfg.proj_out_dim, **factory)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, 378, 378] normalized crops -> [n, 729, enc_dim]."""
        n, c = pixels.shape[:2]
        p = pixels.reshape(n, c, GRID, PATCH_SIZE, GRID, PATCH_SIZE).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_emb(p.reshape(n, GRID * GRID, c * PATCH_SIZE * PATCH_SIZE)) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.post_ln(x)

    def project(self, features: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's crop features [1 + th*tw, 729, enc] -> its embeddings [729, text dim]."""
        pooled = pool_tiles(features[1:], tiling, self.cfg.overlap_margin)
        return self.proj_mlp(torch.cat([features[0], pooled], dim=-1))

    def embed(self, pixels: list[torch.Tensor], tilings: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Several images' crops in one encoder call -> each image's [729, text dim] embeddings."""
        features = self.features(torch.cat(pixels)).split([p.shape[0] for p in pixels])
        return [self.project(f, t) for f, t in zip(features, tilings, strict=True)]


def stitch_tiles(tiles: torch.Tensor, tiling: tuple[int, int], margin: int = 4) -> torch.Tensor:
    """[th*tw, 729, enc] tile features -> the [19*th + 8, 19*tw + 8, enc] grid of their inner parts
    (margin 4 patches: tiles overlap by 8 patches, so tile (i, j) starts at (19 i, 19 j))."""
    th, tw = tiling
    step = GRID - 2 * margin
    grid = tiles.view(th, tw, GRID, GRID, -1)
    out = tiles.new_zeros(step * th + 2 * margin, step * tw + 2 * margin, tiles.shape[-1])
    for i in range(th):
        r0, r1 = (0 if i == 0 else margin), (GRID if i == th - 1 else GRID - margin)
        for j in range(tw):
            c0, c1 = (0 if j == 0 else margin), (GRID if j == tw - 1 else GRID - margin)
            out[step * i + r0 : step * i + r1, step * j + c0 : step * j + c1] = grid[i, j, r0:r1, c0:c1]
    return out


def pool_tiles(tiles: torch.Tensor, tiling: tuple[int, int], margin: int = 4) -> torch.Tensor:
    """Stitched tile features average-pooled to 27x27 -> [729, enc]."""
    grid = stitch_tiles(tiles, tiling, margin)
    pooled = F.adaptive_avg_pool2d(grid.permute(2, 0, 1), (GRID, GRID))
    return pooled.permute(1, 2, 0).reshape(GRID * GRID, -1)
