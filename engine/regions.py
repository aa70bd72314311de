"""Non-token steps: rows whose sample is a region value (Moondream's coordinates and sizes), not a token.

PROBLEM
    Moondream answers detect / point with its region heads: a step may sample a coordinate bin or
    a pair of size bins instead of a token, and the next forward's input is then that value's
    encoding. This must ride the two-slot pipeline like any token step: the forward of step t+1 is
    launched before the host has seen step t's sample, so the value must reach the next input on
    the device, and which head a row samples is only known once its answer's automaton has
    committed step t.
SOLUTION
    Two protocols, each resolved once: a matcher's at submit (sequence.Sequence), a runner's when
    the pipeline is built.
    - `RegionSteps` (a matcher): `step_kind()`, 0 for a token step, k > 0 for the runner's region
      kind k. At finalize (after commit t, so the automaton has seen step t) `stage_kinds` writes
      each row's kind into the slot and lists the region rows.
    - `RegionHeads` (a runner): keeps its last-token hidden states as `last_hidden` after each
      forward (the forward job stores them with the slot), and `sample_regions(hidden, kinds,
      rows, sampled)`, which the sample job calls after sampling tokens as usual: it overwrites the
      region rows' ids, on the device, with value ids: ids past the vocabulary that name a
      coordinate or size (the runner's encoding).
    - The next launch gathers those ids into its input ids on the device exactly as it does for
      tokens (no host round trip); the runner embeds a value id as the value's encoding.
    - At commit the host reads the ids like tokens; the matcher advances over them (eos or the
      last allowed object terminates it). Value ids are never stop ids (they are past the
      vocabulary), and the tokenizer spells them as text (`spells_values`, detokenizer.py).
    Zombies, cancel, blocking mode and streaming need nothing new: a region row is a row.
    - `RegionLogprobs` (optional, a runner): where a step records logprobs, `region_logprobs(...)`
      writes the region rows' entries after `sample_regions`: the log-probability of the value
      sampled and its most likely alternatives, as value ids, from the heads' distributions (what
      scores of region answers are read from). Without it a region row's logprob is NaN.
INVARIANTS
    - A row's kind comes from its matcher after the previous step's commit (like its mask).
    - Rows of kind 0 are never touched by `sample_regions`; finalized rows are kind 0.
    - Kinds are staged only for a runner with region heads; on any other runner every row is a token row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

TOKEN = 0


@runtime_checkable
class RegionSteps(Protocol):
    """A matcher some of whose steps sample a region value rather than a token."""

    def step_kind(self) -> int:
        """What the next step samples: 0 a token, k > 0 the runner's region kind k (from the current state)."""
        ...


@runtime_checkable
class RegionHeads(Protocol):
    """A runner that samples region values on the device after the token sampler."""

    last_hidden: torch.Tensor | None  # [num_seqs, dim] of the latest forward's last query tokens

    def sample_regions(
        self, hidden: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor
    ) -> None:
        """Overwrite `sampled[rows]` (device ids) with region-value ids for those rows' `kinds`,
        read from `hidden` (the step's `last_hidden`); no host synchronisation, no other row touched."""
        ...


@runtime_checkable
class RegionLogprobs(Protocol):
    """A region runner that records its heads' distributions as logprobs (see the module docstring)."""

    def region_logprobs(
        self, hidden: torch.Tensor, kinds: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor, buffers: Any,
        k: int,
    ) -> None:
        """Overwrite the `rows` entries of `buffers` (sampler.LogprobBuffers, which hold the token
        sampler's record of those rows) with the region values' logprob and top k alternatives."""
        ...


def stage_kinds(rows: Sequence[Any], kinds: Any, region_rows: Any) -> int:
    """Write each row's step kind (host buffers); returns the number of region rows listed.

    `rows` are sequence.Sequence records: `step_kind` is their matcher's, resolved at submit (None:
    every step is a token step)."""
    count = 0
    for row, seq in enumerate(rows):
        step_kind = seq.step_kind
        kind = step_kind() if step_kind is not None and not seq.finalized else TOKEN
        kinds[row] = kind
        if kind != TOKEN:
            region_rows[count] = row
            count += 1
    return count
