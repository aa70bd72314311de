"""Moondream 2 on foveal's engine, implemented natively (no remote code from the checkpoint folder).

Files: config.py (dims, special ids, templates), weights.py (the real tensor names), vision.py
(tiling, preprocessing, encoder, stitching, projection), text.py (the decoder on paged KV),
region.py (Fourier features, coordinate / size heads, region-value ids), layers.py.
"""

from foveal.engine.models.moondream.loader import is_moondream, load_folder

__all__ = ["is_moondream", "load_folder"]
