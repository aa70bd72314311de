"""Moondream 2 on foveal's engine, implemented natively: no remote code from the checkpoint folder runs.

DESIGN terms, one concept per file:
    config.py    dims (the real defaults when config.json's `config` entry is empty), special ids, templates
    weights.py   the module tree under the real tensor names; loading with named errors, old layouts refused
    vision.py    overlap tiling, exact preprocessing (PIL LANCZOS, bf16 pixel normalization), encoder,
                 tile stitching and pooling, projection -> 729 image embeddings
    text.py      parallel attention + MLP blocks, partial rotary with half pairing, on the engine's paged KV
                 (attention.PagedKV / build_context): bidirectional BOS + image prefix, then causal
    region.py    Fourier features, coordinate / size encoders and decoders, region-value ids
    answers.py   the decode rules as matchers: the answer-id mask, the detect / point automaton
    runner.py    `MoondreamRunner`, the engine's ModelRunner (image-embedding cache, region sampling)
    processor.py prompt ids + PrefillInputs (crops, tiling, image key, prefix 730)
    tokenizer.py the folder's tokenizer or starmie-v1 from the HF cache; region values spelled as text
    load.py      `load_folder`: the checkpoint on foveal's engine (model_type `moondream1`)
    family.py    `MoondreamFamily`, the plugin: skills in Moondream's own prompts, answers and decode rules

Region decoding inside the two-slot pipeline (forward now, sample later; foveal.engine.regions):
    launch t+1   the forward of step t+1 is queued before commit t. A decode row's input id is gathered
                 on the device from where step t's sampler wrote it; for a region step that id is a
                 *value id* past the vocabulary (V + bin for a coordinate, V + 1024 + 1024 w + h for a
                 size), and the runner embeds it as coord_encoder(fourier(bin / 1024)) or
                 size_encoder(fourier([w, h])) in the same branch-free op that embeds tokens: the value
                 never visits the host on its way to the next input. The forward keeps each row's
                 last hidden state (before post_ln) next to its logits.
    commit t     the host reads step t's ids and advances each answer's automaton (`RegionMatcher`):
                 GATE (eos ends the answer; otherwise the value is the next object's x), COORD (y),
                 SIZE (w, h); the `max_objects`-th object terminates it. Stops, zombies (a step
                 launched after the answer ended carries the row; its id is dropped), cancel and
                 page release are the engine's usual ones: a region row is a row.
    finalize t+1 the automaton, now past step t, says what step t+1 samples (`step_kind`); the kinds
                 go into the slot with the masks, and the sample job, after the token sampler, lets
                 the runner overwrite region rows' ids with value ids read from the region heads of
                 the kept hidden states (a GATE row keeps eos if the sampler chose it). On the device,
                 queued behind the forward: the host waits for nothing.
    text t       the tokenizer spells value ids as `<coord B>` / `<size W H>`; the detect / point
                 skill parses that text back into the reference's floats.
Blocking mode runs the same steps with a wait after each, so pipelined == blocking (tested).
"""

from foveal.families.moondream.family import MoondreamFamily
from foveal.families.moondream.load import is_moondream, load_folder

__all__ = ["MoondreamFamily", "is_moondream", "load_folder"]
