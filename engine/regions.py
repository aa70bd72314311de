"""Non-token steps: rows whose sample is a region value (Moondream's coordinates and sizes), not a token.

PROBLEM
    Moondream answers detect / point with its region heads: a step may sample a coordinate bin or
    a pair of size bins instead of a token, and the next forward's input is then that value's
    encoding. This must ride the two-slot pipeline like any token step: the forward of step t+1 is
    launched before the host has seen step t's sample, so the value must reach the next input on
    the device, and which head a row samples is only known once its answer's automaton has
    committed step t.
SOLUTION
    - A matcher may have `step_kind()`: 0 for a token step, k > 0 for the runner's region kind k.
      At finalize (after commit t, so the automaton has seen step t) `stage_kinds` writes each
      row's kind into the slot and lists the region rows.
    - A runner with region heads (`has_regions`) keeps its last-token hidden states as
      `last_hidden` after each forward; the forward job stores them with the slot.
    - The sample job samples tokens as usual, then `runner.sample_regions(hidden, kinds, rows,
      sampled)` overwrites the region rows' ids, on the device, with value ids: ids past the
      vocabulary that name a coordinate or size (the runner's encoding).
    - The next launch gathers those ids into its input ids on the device exactly as it does for
      tokens (no host round trip); the runner embeds a value id as the value's encoding.
    - At commit the host reads the ids like tokens; the matcher advances over them (eos or the
      last allowed object terminates it). Value ids are never stop ids (they are past the
      vocabulary), and the tokenizer spells them as text (`spells_values`, detokenizer.py).
    Zombies, cancel, blocking mode and streaming need nothing new: a region row is a row.
INVARIANTS
    - A row's kind comes from its matcher after the previous step's commit (like its mask).
    - Rows of kind 0 are never touched by `sample_regions`; finalized rows are kind 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .matcher import FillMasks, Matcher

TOKEN = 0


class RegionRunner(Protocol):
    last_hidden: torch.Tensor | None

    def sample_regions(
        self, hidden: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        """Overwrite `sampled[rows]` (device ids) with region-value ids for those rows' kinds."""
        ...


def has_regions(runner: Any) -> bool:
    return callable(getattr(runner, "sample_regions", None))


def stage_kinds(rows: Sequence[Any], kinds: Any, region_rows: Any) -> int:
    """Write each row's step kind (host buffers); returns the number of region rows listed."""
    count = 0
    for row, seq in enumerate(rows):
        matcher = seq.matcher
        kind = TOKEN
        if matcher is not None and not seq.finalized:
            step_kind = getattr(matcher, "step_kind", None)
            kind = step_kind() if step_kind is not None else TOKEN
        kinds[row] = kind
        if kind != TOKEN:
            region_rows[count] = row
            count += 1
    return count


def own_masks(native: FillMasks) -> FillMasks:
    """A FillMasks where matchers marked `fills_own_mask` fill their own rows and the others go to
    `native` in one call (as a row -> matcher mapping, which foveal.grammars.fill_masks takes)."""

    def fill(matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        others: dict[int, Matcher] = {}
        for row, matcher in enumerate(matchers):
            if getattr(matcher, "fills_own_mask", False):
                matcher.fill_mask(bitmask, row)
            else:
                others[row] = matcher
        if others:
            native(others if len(others) < len(matchers) else list(matchers), bitmask)

    return fill
