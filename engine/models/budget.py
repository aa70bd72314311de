"""Sizing the KV page pool from a memory budget (bytes per token come from the runner's family config)."""

from __future__ import annotations

import os

import torch

from foveal.engine.runner import ModelRunner


def pages_for_budget(runner: ModelRunner, budget_bytes: int, page_size: int = 16) -> int:
    """How many pages of `page_size` tokens fit in `budget_bytes`; raises when not even one does."""
    page_bytes = runner.kv_bytes_per_token() * page_size
    pages = budget_bytes // page_bytes
    if pages < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no page of {page_size} tokens ({page_bytes} bytes); raise it"
        )
    return int(pages)


def default_budget_bytes(device: torch.device, fraction: float = 0.25) -> int:
    """A default KV budget: `fraction` of the device's free memory (CUDA) or of available RAM (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages * fraction)
