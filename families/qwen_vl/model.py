"""Qwen2.5-VL and Qwen3-VL on foveal's paged attention: M-RoPE positions, their processor, their image features.

PROBLEM
    Three things set these families apart from the generic runner (runner.py):
    1. Multimodal rotary positions (M-RoPE). Each token has three positions (time, height, width).
       Text tokens have three equal ones; an image's tokens count along its grid, and the text after
       it continues from the image's largest position + 1, so a prompt's positions fall behind its
       token count by a per-sequence "rope delta" that every later token (decode, jump-forward)
       must add. The engine knows token indices only (`ForwardBatch.positions`, also what the
       attention mask is built from), and a decode launch must not ask the host for anything.
    2. The processor. transformers 5.24 cannot build `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` (nor
       `AutoProcessor`) from a folder without torchvision, because `from_pretrained` also loads the
       video processor (`OSError: Can't load video processor`), and torchvision does not import
       beside foveal's CPU torch. The image processor (`Qwen2VLImageProcessorPil`, both families)
       and the processors' own text expansion work without it.
    3. Qwen3-VL's DeepStack: besides the features scattered over the image tokens, the vision tower
       returns one feature map per `deepstack_visual_indexes` layer, added to the hidden states of
       the first decoder layers at the image tokens. A cached image must bring those back too.

SOLUTION
    1. Positions are state kept beside the K/V, keyed by KV row. The input processor computes a
       prompt's three position streams on the host with the model's own `get_rope_index` (its
       config only, no weights) and carries them, with each token's "delta for what follows", in
       `PrefillInputs.image_tensors` (`mrope_positions` [3, L], `mrope_next_delta` [L]). The runner
       keeps one int64 per KV row (`row_delta`): every launch writes, at its tokens' `kv_index`,
       the delta a token following them would add. A token whose sequence has no position table
       in the launch (decode, jump-forward, a text-only prompt, a prefix-cached start) reads the
       delta at the row of its sequence's previous position, found through the block table, and
       gets `position + delta` on all three streams. Everything is gathered on the device; the
       engine, the scheduler and the attention mask keep token indices and never learn of M-RoPE.
       Why per row and not per request: a token's M-RoPE position depends only on the tokens before
       it, so per-row state stays right under page sharing (prefix cache), zombies and preemption,
       and needs no request identity in the batch. `row_delta` rides after the K tensors into the
       launch (and into traced decode graphs, traced.py, as an input like the KV tensors: a trace
       would otherwise bake it in as a constant), so CPU decode replays graphs as every family does.
    2. `images_only(cls)`: a subclass of the family's real processor whose constructor takes only
       the image processor and the tokenizer. transformers derives a processor's parts from its
       `__init__` signature (`ProcessorMixin.get_attributes`), so the subclass has no video part to
       check or load, while placeholder expansion (`<|image_pad|>` x grid / merge^2) and
       `mm_token_type_ids` (what `get_rope_index` reads) are the real class's code. Resizing is the
       real image processor's `smart_resize`; `min_pixels` / `max_pixels` come from the folder or
       from `load(..., image_options={"min_pixels": .., "max_pixels": ..})`.
    3. Qwen3-VL's runner stores an image's features as one [tokens, hidden * (1 + deepstack)] row
       block (main features, then each DeepStack map), so the image cache and its row-count check
       work unchanged, and splits them back into `deepstack_features` for the forward.

INVARIANTS (tests/models/test_qwen_vl.py)
    - Greedy tokens equal transformers' `generate` and logits agree within 1e-4 (fp32) for prompts
      with images of different sizes, two images in one prompt, and text only, batched together.
    - No host synchronisation in `position_ids`: the prefill tables' offsets are host ints from
      tensor shapes, copied to the device without a wait.
    - Traced decode replays give the logits of the eager forward (parity tests: every decode launch
      on CPU is a replay).
    - A row's delta is written by the launch that writes its K/V, before any later token reads it.
    - A checkpoint this module cannot run (no vision tower, no image placeholder token, a rope type
      other than M-RoPE's default, a video-only processor config) is refused at load, naming what is
      missing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES
from foveal.engine.models.loader import image_processor_settings
from foveal.engine.models.processor import InputProcessor, PromptInputs, to_pil
from foveal.engine.models.runner import HFRunner
from foveal.engine.request import PrefillInputs
from foveal.engine.runner import ForwardBatch

IMAGE_PAD = "<|image_pad|>"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a prompt, before expansion
POSITIONS, NEXT_DELTA = "mrope_positions", "mrope_next_delta"  # PrefillInputs.image_tensors keys
IMAGE_OPTIONS = ("min_pixels", "max_pixels")


# ---- load-time checks ---------------------------------------------------------------------------------------


def check_config(raw: Mapping[str, Any], path: Path) -> None:
    """Refuse a folder this module cannot run, before any weights are read (the message names what is missing)."""
    arch = (raw.get("architectures") or ["?"])[0]
    if not isinstance(raw.get("vision_config"), Mapping):
        raise ModelLoadError(
            f"{path}: config.json of {arch} has no vision_config; foveal runs Qwen-VL on images"
        )
    if raw.get("image_token_id") is None:
        raise ModelLoadError(
            f"{path}: config.json of {arch} has no image_token_id (a video-only checkpoint?); "
            "foveal runs Qwen-VL on images and needs the image placeholder token"
        )
    text = raw.get("text_config") or raw
    rope = text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ModelLoadError(
            f"{path}: rope type {rope_type!r} is not supported for {arch}; foveal runs M-RoPE's default "
            "rotary (rope_type 'default' or 'mrope' with mrope_section)"
        )
    if not rope.get("mrope_section"):
        raise ModelLoadError(
            f"{path}: the rope parameters of {arch} have no mrope_section; M-RoPE needs the split of the "
            "rotary dimensions into time, height and width sections"
        )
    settings = image_processor_settings(path)
    if settings is not None and settings.get("image_processor_type") is None:
        raise ModelLoadError(
            f"{path}: the image processor settings name no image_processor_type (a video processor only?); "
            "save the checkpoint's Qwen2VLImageProcessor with it"
        )


# ---- the processor (image + text, no video) -------------------------------------------------------------------


def images_only(processor_class: type) -> type:
    """A subclass of `processor_class` (Qwen2_5_VLProcessor, Qwen3VLProcessor) without its video processor.

    transformers reads a processor's parts from its `__init__` parameters (`ProcessorMixin.get_attributes`);
    this `__init__` names only the image processor and the tokenizer, so the video processor, whose
    loading needs torchvision, is neither required nor type-checked. The parent's constructor receives
    video_processor=None, which its attribute loop ignores (it zips arguments with the two attributes).
    Everything else (placeholder expansion, mm_token_type_ids, chat template) is the real class's code.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # the given class's own __init__, by design (a subclass's is this one)
        processor_class.__init__(  # type: ignore[misc]
            self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs
        )

    return type(f"{processor_class.__name__}ImagesOnly", (processor_class,), {"__init__": __init__})


def load_processor(arch: Architecture, path: Path, image_options: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """(hf processor, tokenizer) of a Qwen-VL folder: its image processor and tokenizer under the images-only class."""
    options = dict(image_options or {})
    unknown = sorted(set(options) - set(IMAGE_OPTIONS))
    if unknown:
        raise ModelLoadError(
            f"image_options {', '.join(unknown)} are not understood for {arch.name}; use {', '.join(IMAGE_OPTIONS)}"
        )
    for name, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"image_options[{name!r}] must be a positive pixel count, got {value!r}")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    size = dict(image_processor.size)  # {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    size["shortest_edge"] = options.get("min_pixels", size["shortest_edge"])
    size["longest_edge"] = options.get("max_pixels", size["longest_edge"])
    if size["shortest_edge"] > size["longest_edge"]:
        raise ModelLoadError(
            f"min_pixels={size['shortest_edge']} exceeds max_pixels={size['longest_edge']}; choose min <= max"
        )
    image_processor.size = size
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.convert_tokens_to_ids(IMAGE_PAD) in (None, tokenizer.unk_token_id):
        raise ModelLoadError(
            f"{path}: the tokenizer has no {IMAGE_PAD} token; save the checkpoint's own tokenizer"
        )
    # The processor renders conversations with the checkpoint's template, as the real class would.
    assert arch.processor_class is not None  # a vision architecture's
    processor_class = images_only(getattr(transformers, arch.processor_class))
    processor = processor_class(image_processor, tokenizer, chat_template=tokenizer.chat_template)
    return processor, tokenizer


class QwenInputProcessor(InputProcessor):
    """Text + one image or a list of images -> prompt ids and PrefillInputs with the M-RoPE position table."""

    def __init__(
        self, arch: Architecture, tokenizer: Any, hf_processor: Any, model: Any, runner: HFRunner
    ) -> None:
        super().__init__(
            arch, tokenizer, hf_processor, runner.device, runner.dtype, model.config.image_token_id
        )
        # The model's own rope-index computation: it reads the config only, so it runs here on CPU tensors.
        self.rope_index = model.model.get_rope_index
        image_processor = hf_processor.image_processor
        self.patch_size: int = image_processor.patch_size
        self.merge_size: int = image_processor.merge_size

    def __call__(
        self, text: str, image: Any = None, image_key: str | None = None, add_special_tokens: bool = True
    ) -> PromptInputs:
        if image is None or (isinstance(image, (list, tuple)) and not image):
            return self._text_only(text, add_special_tokens)
        pictures = [to_pil(one) for one in (image if isinstance(image, (list, tuple)) else [image])]
        if PLACEHOLDER not in text:
            text = PLACEHOLDER * len(pictures) + text
        if text.count(PLACEHOLDER) != len(pictures):
            raise ValueError(
                f"the prompt has {text.count(PLACEHOLDER)} image placeholders ({PLACEHOLDER}) for {len(pictures)} images; "
                "write one per image, or none to put them all in front"
            )
        special = {} if add_special_tokens else {"add_special_tokens": False}
        out = self.hf_processor(images=pictures, text=[text], return_tensors="pt", **special)
        ids = out["input_ids"]
        positions, _ = self.rope_index(
            ids, mm_token_type_ids=out["mm_token_type_ids"], image_grid_thw=out["image_grid_thw"]
        )
        positions = positions[:, 0]  # [3, L]
        # What a token after token l adds to its index: the largest position so far + 1 - (l + 1).
        next_delta = positions.amax(0).cummax(0).values - torch.arange(positions.shape[1])
        tensors = {
            "pixel_values": out["pixel_values"].to(self.device, self.dtype),
            "image_grid_thw": out["image_grid_thw"].to(self.device),
            POSITIONS: positions.to(self.device),
            NEXT_DELTA: next_delta.to(self.device),
            # not read by the runner: what transformers' own forward needs to rebuild these positions
            "mm_token_type_ids": out["mm_token_type_ids"].to(self.device),
        }
        num_image_tokens = int((ids[0] == self.image_token_id).sum())
        prefill = PrefillInputs(tensors, num_image_tokens, image_key, image_token_id=self.image_token_id)
        return PromptInputs(ids[0].tolist(), prefill)

    def resized_sizes(self, prefill: PrefillInputs) -> list[tuple[int, int]]:
        """(width, height) in pixels of each image as the model saw it (after the processor's resizing)."""
        grid = prefill.image_tensors["image_grid_thw"].tolist()
        return [(w * self.patch_size, h * self.patch_size) for _, h, w in grid]


# ---- the runner -----------------------------------------------------------------------------------------------


class QwenVLRunner(HFRunner):
    """HFRunner with M-RoPE positions (see the module docstring) and, for Qwen3-VL, DeepStack features."""

    # A row reads the row delta stored at the position before its first token before the launch
    # writes its own: rows of one launch must not share a sequence (runner.SharedPages).
    rows_share_pages = False

    def __init__(
        self,
        model: torch.nn.Module,
        arch: Architecture,
        image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
        trace_decode: bool | None = None,
    ):
        super().__init__(model, arch, trace_decode=trace_decode, image_cache_bytes=image_cache_bytes)
        # (torch types a module's attributes Tensor | Module: mypy cannot see the model's config or methods)
        self.hidden: int = model.config.get_text_config().hidden_size  # type: ignore[union-attr, operator]
        self.deepstack: int = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())  # type: ignore[union-attr]
        self.row_delta: torch.Tensor | None = None
        # The row deltas this launch reads and writes. Per thread: a decode bucket's trace runs on
        # the tracer's thread beside the device thread's forwards (traced.py).
        self._launch = threading.local()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """HFRunner.forward with `row_delta` riding after the K tensors: an input of a traced decode
        graph like the KV tensors (traced.py), never a constant baked into it."""
        kv = self.kv
        if kv is None:
            raise RuntimeError("allocate_kv(num_pages, page_size) must be called before forward()")
        assert self.row_delta is not None  # made with the KV (allocate_kv)
        ks = [*kv.k, self.row_delta]
        if batch.is_decode and self.decode_graphs is not None and not batch.prefill:
            return self.decode_graphs(batch, ks, kv.v, kv.page_size, kv.scratch_page)
        return self._eager(batch, ks, kv.v)

    def _eager(self, batch: ForwardBatch, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        *ks, self._launch.delta = ks
        try:
            return super()._eager(batch, ks, vs)
        finally:
            self._launch.delta = None

    # no sliding_pages: the engine passes it only to a runner with a sliding window, which this is not
    def allocate_kv(self, num_pages: int, page_size: int) -> None:  # type: ignore[override]
        super().allocate_kv(num_pages, page_size)
        self.row_delta = torch.zeros((num_pages + 1) * page_size, dtype=torch.int64, device=self.device)

    def position_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """[3, 1, T] M-RoPE positions of the launch's tokens; writes each token's row delta (device ops only)."""
        assert self.kv is not None  # allocate_kv ran (forward checks it)
        device, page_size, row_delta = self.device, self.kv.page_size, self._launch.delta
        num_tokens = batch.input_ids.shape[0]
        starts = batch.query_start.to(torch.int64)
        seq = torch.searchsorted(starts[1:], torch.arange(num_tokens, device=device), right=True)
        # Each sequence's delta so far: the one stored at the row of the position before its first query token.
        first = batch.positions[starts[:-1]]
        prev = (first - 1).clamp(min=0)
        page = batch.block_tables.to(torch.int64).gather(1, (prev // page_size)[:, None])[:, 0].clamp(min=0)
        prior = torch.where(first > 0, row_delta[page * page_size + prev % page_size], 0)
        positions = (batch.positions + prior[seq]).expand(3, num_tokens)
        token_delta = prior[seq]
        tables = [
            (i, p) for i, p in enumerate(batch.prefill) if p is not None and POSITIONS in p.image_tensors
        ]
        if tables:  # prompts with images: their own positions, looked up by token index in one flat table
            flat = torch.cat([p.image_tensors[POSITIONS] for _, p in tables], dim=1)
            flat_delta = torch.cat([p.image_tensors[NEXT_DELTA] for _, p in tables])
            offsets, has_table, at = [0] * batch.num_seqs, [False] * batch.num_seqs, 0
            for i, p in tables:
                offsets[i], has_table[i] = at, True
                at += p.image_tensors[POSITIONS].shape[1]
            offsets_t = torch.tensor(offsets, dtype=torch.int64).to(device, non_blocking=True)
            has_t = torch.tensor(has_table).to(device, non_blocking=True)[seq]
            index = (offsets_t[seq] + batch.positions).clamp(max=flat.shape[1] - 1)
            positions = torch.where(has_t, flat[:, index], positions)
            token_delta = torch.where(has_t, flat_delta[index], token_delta)
        row_delta.index_copy_(0, batch.kv_index, token_delta)
        return positions[:, None, :]

    def encode_images(self, images: list[PrefillInputs]) -> list[torch.Tensor]:
        if not self.deepstack:
            return super().encode_images(images)
        out = self.model.get_image_features(**self.arch.image_kwargs(images))  # type: ignore[operator]  # (as in __init__)
        parts = [torch.cat(out.pooler_output)] + [torch.cat(maps) for maps in out.deepstack_features]
        joined = torch.cat(parts, dim=-1)  # [tokens, hidden * (1 + deepstack)]
        return list(joined.split([image.num_image_tokens for image in images]))

    def _image_inputs(self, images: list[PrefillInputs]) -> dict[str, Any]:
        inputs = super()._image_inputs(images)
        if not inputs or not self.deepstack:
            return inputs
        (joined,) = inputs["mm_encoder_outputs"]["image"].pooler_output
        main, *maps = joined.split(self.hidden, dim=-1)
        # Qwen3VLModel.forward concatenates each list (one entry per image batch; here the launch's);
        # the fields are typed Tensor | None and list[Tensor]
        outputs = BaseModelOutputWithDeepstackFeatures(
            pooler_output=[main], deepstack_features=[[m] for m in maps]  # type: ignore[arg-type, misc]
        )
        return {"mm_encoder_outputs": {"image": outputs}}
