"""Train foveal's embedded default model: a tiny PaliGemma on synthetic shape scenes.

`python -m foveal.training.train_shapes --run runs/shapes --steps 20000` trains (or resumes from the run
folder's last.pt) and `--export sdk/embedded` writes the Hugging Face folder that ships in the
package. `--config '{"init_from": "runs/a/last.pt"}'` starts a new run from another run's weights
(a checkpoint, or an exported folder such as sdk/embedded/, which is how to continue from the
shipped model; docs/models/shapes.md lists the stages that made it).

PROBLEM: a model that really answers detect / point / caption / query on the shapes world has to
be trained on this project's own CPU budget (a few CPU-hours), reproducibly, and interrupted runs
must continue where they stopped.

SOLUTION: a small SigLIP + Gemma PaliGemma built from configs (`build_model`), a byte-level BPE
tokenizer over the world's words plus PaliGemma's <image>/<locNNNN>/<segNNN> tokens
(`build_tokenizer`), batches drawn from a generator seeded by (seed, step) so that the data of a
step never depends on what ran before, soft neighbour-smoothed targets over the location bins
(a near miss costs less than a far one: a denser signal than one-hot), an auxiliary dense loss
on the image features (per patch: colour, shape and box of the object there; `patch_targets`),
2-D sine-cosine init of the vision position embeddings, and checkpoints holding model, auxiliary
head, optimizer, step and torch RNG state. The run folder keeps its config.json and tokenizer, so
a resume depends on neither the command line nor the current corpus code.

INVARIANTS (tests/training/test_train_shapes.py):
1. Same seed and config, same batches and same weights (determinism).
2. Training n steps in one go equals training k steps, stopping, and resuming to n.
3. Training input ids equal what transformers' PaliGemmaProcessor builds for the same prompt/suffix.
4. Training scene seeds are >= TRAIN_SEED_BASE; evaluation uses seeds below it.
5. Every detect/point target is accepted by the project's spatial grammar (grammars.spatial).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from foveal.families.shapes.format import CHAT_TEMPLATE, ShapesFormat
from foveal.training import chat_data
from foveal.vision import scenes

TRAIN_SEED_BASE = 1_000_000_000
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", IMAGE_TOKEN]
EXTRA_TOKENS = [f"<loc{i:04d}>" for i in range(1024)] + [f"<seg{i:03d}>" for i in range(128)]

# What `Trainer.export` writes: the files a loader of the exported folder may rely on.
EXPORTED_FILES = frozenset(
    {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "preprocessor_config.json",
        "foveal.json",
        "chat_template.jinja",
    }
)


@dataclass(slots=True)
class TrainConfig:
    seed: int = 0
    steps: int = 20000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 300
    weight_decay: float = 0.01
    image_size: int = 64
    patch_size: int = 8
    vision_width: int = 128
    vision_layers: int = 4
    text_width: int = 192
    text_layers: int = 4
    n_bins: int = 32
    loc_weight: float = 2.0
    loc_sigma: float = 0.7  # bins; spread of the soft location targets
    task_weights: dict[str, float] = field(
        default_factory=lambda: {"detect": 0.35, "point": 0.2, "caption": 0.2, "query": 0.25}
    )
    # "chat" in task_weights is the share of steps whose whole batch is chat examples, of this size:
    # chat prompts are several times longer than the task prefixes, and a batch pads to its longest
    chat_batch_size: int = 16
    chat_kinds: dict[str, float] | None = None  # shares of chat_data.KINDS; None: chat_data.KIND_WEIGHTS
    render_sizes: tuple[int, int] = (64, 160)  # scenes render at a random size in this range, then resize
    aux_weight: float = 0.5  # dense per-patch loss on the image features (see patch_targets); 0: off
    init_from: str | None = None  # start from this checkpoint's model weights (a warm start), not random
    bf16: bool = True  # bf16 autocast: faster steps on CPUs with native bf16 (avx512_bf16); weights stay fp32


# ---- tokenizer and model ----------------------------------------------------------------------


def world_corpus(fmt: ShapesFormat, n_scenes: int = 400) -> list[str]:
    """Every kind of text the model reads or writes, from a fixed set of scenes."""
    texts = list(fmt.prompts.values())
    for seed in range(TRAIN_SEED_BASE, TRAIN_SEED_BASE + n_scenes):
        scene = scenes.generate_scene(seed)
        texts += [scenes.caption(scene, n) for n in ("short", "normal", "long")]
        texts += [f"{q} {a}" for pairs in scenes.questions(scene).values() for q, a in pairs]
    texts += [fmt.prompt(s, object=p) for s in ("detect", "point") for p in scenes.all_phrases()]
    for seed in range(TRAIN_SEED_BASE, TRAIN_SEED_BASE + 50):
        scene = scenes.generate_scene(seed)
        texts += [fmt.detect_target(scene, "shape"), fmt.point_target(scene, "shape")]
    texts += [fmt.prompt("caption", length=n) for n in ("short", "normal", "long")]
    return texts


def build_tokenizer(fmt: ShapesFormat):
    """Byte-level BPE over the world's words: any string encodes, each world word is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(world_corpus(fmt), trainer)
    # Pairs carry token_type_ids 0 (prefix) / 1 (suffix), which is how PaliGemma marks the answer.
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    # PaliGemmaProcessor adds these on load; shipping them keeps vocabulary and embeddings the same size.
    fast.add_tokens(EXTRA_TOKENS)
    return fast


def build_model(cfg: TrainConfig, vocab_size: int, image_token_id: int, pad_token_id: int):
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    vision = SiglipVisionConfig(
        hidden_size=cfg.vision_width,
        intermediate_size=4 * cfg.vision_width,
        num_hidden_layers=cfg.vision_layers,
        num_attention_heads=cfg.vision_width // 32,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        vision_use_head=False,
    )
    text = GemmaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.text_width,
        intermediate_size=3 * cfg.text_width,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_width // 64,
        num_key_value_heads=cfg.text_width // 64,
        head_dim=64,
        max_position_embeddings=512,
        pad_token_id=pad_token_id,
        bos_token_id=2,
        eos_token_id=1,
    )
    config = PaliGemmaConfig(  # type: ignore[call-arg]  # *_token_id: extra keywords, taken at runtime, not in its dataclass signature
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vocab_size=vocab_size,
        projection_dim=cfg.text_width,
        hidden_size=cfg.text_width,
        pad_token_id=pad_token_id,
        bos_token_id=2,
        eos_token_id=1,
    )
    torch.manual_seed(cfg.seed)
    model = PaliGemmaForConditionalGeneration(config)
    grid = cfg.image_size // cfg.patch_size
    with torch.no_grad():
        model.model.vision_tower.embeddings.position_embedding.weight.copy_(sincos_2d(grid, cfg.vision_width))
    return model


def sincos_2d(grid: int, width: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine codes of the patch grid (row-major), used to initialize SigLIP's learned
    position embeddings. Why: the default init (std 0.09) is drowned by the patch content (std ~0.7),
    so the model first has to discover where each patch is; boxes stayed collapsed to one mean box
    for the first 1,000 steps of a run without this. Half the channels code the row, half the column."""
    if width % 4:
        raise ValueError(f"vision width {width} must be a multiple of 4 for 2-D sine-cosine positions")
    freqs = 1.0 / 10000 ** (torch.arange(width // 4, dtype=torch.float32) / (width // 4))
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def code(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.flatten().float()[:, None] * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([code(rows), code(cols)], dim=1)


# ---- data ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Example:
    """One training example: its scene, skill, prompt text (after the image placeholders) and target.
    A chat example's prompt is its conversation rendered by the chat template, and it may show
    `more` scenes after the first (images in later turns), in image order."""

    scene: scenes.Scene
    skill: str
    prompt: str
    target: str
    more: tuple[scenes.Scene, ...] = ()

    @property
    def scenes(self) -> tuple[scenes.Scene, ...]:
        return (self.scene, *self.more)


def sample_example(rng: np.random.Generator, cfg: TrainConfig, fmt: ShapesFormat) -> Example:
    """An example of a task skill drawn by `cfg.task_weights` (chat examples: `ChatRenderer`)."""
    scene = _training_scene(rng, cfg)
    skills, weights = zip(*cfg.task_weights.items(), strict=True)
    skill = skills[int(rng.choice(len(skills), p=np.array(weights) / sum(weights)))]
    return make_example(rng, scene, skill, fmt)


def _training_scene(rng: np.random.Generator, cfg: TrainConfig) -> scenes.Scene:
    size = int(rng.integers(cfg.render_sizes[0], cfg.render_sizes[1] + 1))
    aspect = 1.0 if rng.random() < 0.8 else float(rng.uniform(0.7, 1.4))
    return scenes.generate_scene(int(rng.integers(TRAIN_SEED_BASE, 2**62)), size, max(32, round(size * aspect)))


class ChatRenderer:
    """Chat examples (training/chat_data.py) rendered by the model's chat template through
    PaliGemmaProcessor's own `apply_chat_template`: the prompt `model.chat` sends, image
    placeholders first (stripped here: `encode_example` writes them, with BOS after the last)."""

    def __init__(self, tok, n_image_tokens: int, kinds: dict[str, float] | None = None) -> None:
        from transformers import PaliGemmaProcessor, SiglipImageProcessor

        self.kinds = kinds
        image_processor = SiglipImageProcessor()
        image_processor.image_seq_length = n_image_tokens  # type: ignore[attr-defined]  # read by PaliGemmaProcessor; no class declares it
        self.processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE)

    def render(self, conversation) -> tuple[str, int]:
        """(the rendered prompt after its image placeholders, the number of images)."""
        from foveal.families.conversation import to_hf, tools_of

        tools = tools_of(conversation) or None
        text = self.processor.apply_chat_template(
            to_hf(conversation, vision=True), tools=tools, tokenize=False, add_generation_prompt=True
        )
        images = 0
        while text.startswith(IMAGE_TOKEN, images * len(IMAGE_TOKEN)):
            images += 1
        if IMAGE_TOKEN in text[images * len(IMAGE_TOKEN) :]:
            raise ValueError("the chat template must write every image placeholder first")
        return text[images * len(IMAGE_TOKEN) :], images

    def example(self, rng: np.random.Generator, scene: scenes.Scene, new_scene) -> Example:
        drawn = iter([scene])
        example = chat_data.sample_chat(rng, lambda r: next(drawn, None) or new_scene(r), weights=self.kinds)
        prompt, images = self.render(example.conversation)
        if images != len(example.images):
            raise ValueError(f"the conversation shows {images} images but holds {len(example.images)} scenes")
        first, *more = example.images
        return Example(first, "chat", prompt, example.target, tuple(more))


def make_example(rng: np.random.Generator, scene: scenes.Scene, skill: str, fmt: ShapesFormat) -> Example:
    if skill in ("detect", "point"):
        phrase = sample_phrase(rng, scene)
        target = fmt.detect_target(scene, phrase) if skill == "detect" else fmt.point_target(scene, phrase)
        return Example(scene, skill, fmt.prompt(skill, object=phrase), target)
    if skill == "caption":
        length = ("short", "normal", "long")[int(rng.choice(3, p=[0.25, 0.45, 0.3]))]
        return Example(scene, skill, fmt.prompt(skill, length=length), scenes.caption(scene, length))
    question, answer = sample_question(rng, scene)
    return Example(scene, skill, fmt.prompt("query", question=question), answer)


def sample_phrase(rng: np.random.Generator, scene: scenes.Scene) -> str:
    """Mostly phrases that match something, some that may not (the answer is then empty)."""
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    r = rng.random()
    if r < 0.35:
        return obj.shape
    if r < 0.65:
        return obj.phrase()
    if r < 0.80:
        return "shape"
    if r < 0.85:
        return f"{obj.colour} shape"
    phrases = scenes.all_phrases()
    return phrases[int(rng.integers(len(phrases)))]


def sample_question(rng: np.random.Generator, scene: scenes.Scene) -> tuple[str, str]:
    """A kind first (uniform over the kinds the scene allows), then a question of that kind."""
    pairs = scenes.questions(scene)
    kinds = [k for k, v in pairs.items() if v]
    kind = kinds[int(rng.integers(len(kinds)))]
    options = pairs[kind]
    if kind == "count" and rng.random() < 0.7:
        # Counts of absent phrases dominate the list; ask mostly about what is there.
        present = [(q, a) for q, a in options if a != "0"]
        options = present or options
    return options[int(rng.integers(len(options)))]


def pixel_tensor(image: Image.Image, size: int) -> torch.Tensor:
    """SigLIP preprocessing (resize bicubic, rescale 1/255, normalize mean 0.5 std 0.5), CHW float."""
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy((arr - 0.5) / 0.5).permute(2, 0, 1).contiguous()


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    pixel_values: torch.Tensor
    labels: torch.Tensor  # -100 outside the suffix
    # per image (I >= B: a chat example may show several), in the order of the images' tokens
    patch_colour: torch.Tensor  # (I, P) 0: background, 1..6: colour of the object covering the patch
    patch_shape: torch.Tensor  # (I, P) 0: background, 1..3: shape
    patch_box: torch.Tensor  # (I, P, 4) that object's (x_min, y_min, x_max, y_max); 0 on background
    patch_centre: torch.Tensor  # (I, P) 1.0 on the patch holding an object's centre, else 0.0


def encode_example(tok, prompt: str, target: str, n_image_tokens: int) -> tuple[list[int], int]:
    """PaliGemma layout: <image> x n, <bos>, prompt, "\\n" | target, <eos>. Returns ids and prefix length."""
    prefix = [tok.convert_tokens_to_ids(IMAGE_TOKEN)] * n_image_tokens + [tok.bos_token_id]
    prefix += tok(prompt + "\n", add_special_tokens=False)["input_ids"]
    suffix = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return prefix + suffix, len(prefix)


def collate(examples: list[Example], tok, cfg: TrainConfig, n_image_tokens: int) -> Batch:
    encoded = [encode_example(tok, e.prompt, e.target, n_image_tokens * len(e.scenes)) for e in examples]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(examples), width), tok.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    types = torch.ones_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, n_prefix) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        types[row, :n_prefix] = 0
        labels[row, n_prefix : len(ids)] = torch.tensor(ids[n_prefix:])
    shown = [scene for e in examples for scene in e.scenes]  # every image, in the order of its tokens
    pixels = torch.stack([pixel_tensor(scenes.render(scene), cfg.image_size) for scene in shown])
    grid = cfg.image_size // cfg.patch_size
    colour, shape, box, centre = zip(*(patch_targets(scene, grid) for scene in shown), strict=True)
    return Batch(
        input_ids,
        attention,
        types,
        pixels,
        labels,
        torch.stack(colour),
        torch.stack(shape),
        torch.stack(box),
        torch.stack(centre),
    )


def patch_targets(scene: scenes.Scene, grid: int) -> tuple[torch.Tensor, ...]:
    """Dense labels of the image features: per patch, the object whose box holds the patch centre
    (plus, for every object, the patch holding its own centre, so objects smaller than a patch
    count too), and a flag on that one centre patch per object. Why: the answer tokens give the
    vision tower one sparse signal per object; a label per patch teaches it colour, shape and
    extent directly, and the centre flag marks each object exactly once, which is what counting
    and listing objects in a caption need (an auxiliary loss: nothing of it is exported)."""
    colour = torch.zeros(grid * grid, dtype=torch.long)
    centre = torch.zeros(grid * grid)
    shape = torch.zeros(grid * grid, dtype=torch.long)
    box = torch.zeros(grid * grid, 4)
    centres = (torch.arange(grid, dtype=torch.float32) + 0.5) / grid
    for o in scene.objects:
        b = torch.tensor(o.box(scene.width, scene.height))
        cx, cy = o.centre(scene.width, scene.height)
        inside = (
            (centres[None] >= b[0])
            & (centres[None] < b[2])
            & (centres[:, None] >= b[1])
            & (centres[:, None] < b[3])
        ).flatten()
        k = min(int(cy * grid), grid - 1) * grid + min(int(cx * grid), grid - 1)
        inside[k] = True
        centre[k] = 1.0
        colour[inside] = 1 + list(scenes.COLOURS).index(o.colour)
        shape[inside] = 1 + scenes.SHAPES.index(o.shape)
        box[inside] = b
    return colour, shape, box, centre


def aux_loss(features: torch.Tensor, head: torch.nn.Linear, batch: Batch) -> torch.Tensor:
    """Colour and shape cross-entropy on every patch, L1 on the box of covered patches, binary
    cross-entropy of the centre flag. Head outputs: colours+1, shapes+1, centre, box (4)."""
    out = head(features.float())
    n_colours, n_shapes = len(scenes.COLOURS) + 1, len(scenes.SHAPES) + 1
    loss = F.cross_entropy(out[..., :n_colours].flatten(0, 1), batch.patch_colour.flatten())
    shape_logits = out[..., n_colours : n_colours + n_shapes]
    loss = loss + F.cross_entropy(shape_logits.flatten(0, 1), batch.patch_shape.flatten())
    loss = loss + F.binary_cross_entropy_with_logits(out[..., -5], batch.patch_centre)
    covered = batch.patch_colour > 0
    return loss + 4.0 * F.l1_loss(out[..., -4:].sigmoid()[covered], batch.patch_box[covered])


def batch_for_step(
    step: int, cfg: TrainConfig, fmt: ShapesFormat, tok, n_image_tokens: int, chat: ChatRenderer | None = None
) -> Batch:
    """The batch of a step depends on (seed, step) only: resuming replays the same data."""
    rng = np.random.default_rng([cfg.seed, step])
    share = cfg.task_weights.get("chat", 0.0) / sum(cfg.task_weights.values())
    if share and rng.random() < share:
        if chat is None:
            raise ValueError("chat examples need the run's chat renderer (ChatRenderer)")
        first = lambda r: _training_scene(r, cfg)  # noqa: E731
        examples = [chat.example(rng, first(rng), first) for _ in range(cfg.chat_batch_size)]
    else:
        tasks = replace(cfg, task_weights={k: w for k, w in cfg.task_weights.items() if k != "chat"})
        examples = [sample_example(rng, tasks, fmt) for _ in range(cfg.batch_size)]
    return collate(examples, tok, cfg, n_image_tokens)


# ---- loss ---------------------------------------------------------------------------------------


def loss_fn(
    logits: torch.Tensor, labels: torch.Tensor, loc_ids: torch.Tensor, cfg: TrainConfig
) -> torch.Tensor:
    """Next-token cross-entropy on the suffix; location tokens get soft targets and extra weight."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    keep = labels != -100
    logits, labels = logits[keep], labels[keep]
    logp = F.log_softmax(logits, dim=-1)
    target = F.one_hot(labels, logits.shape[-1]).float()
    # Location k: Gaussian over the N loc tokens around k, so near misses cost less.
    is_loc = (labels >= loc_ids[0]) & (labels <= loc_ids[-1])
    if is_loc.any():
        k = (labels[is_loc] - loc_ids[0]).float()
        bins = torch.arange(len(loc_ids), dtype=torch.float32)
        soft = torch.exp(-0.5 * ((bins[None] - k[:, None]) / cfg.loc_sigma) ** 2)
        soft = soft / soft.sum(-1, keepdim=True)
        rows = torch.zeros(int(is_loc.sum()), logits.shape[-1])
        rows[:, loc_ids] = soft
        target[is_loc] = rows
    per_token = -(target * logp).sum(-1)
    weight = torch.where(is_loc, cfg.loc_weight, 1.0)
    return (per_token * weight).sum() / weight.sum()


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---- run ----------------------------------------------------------------------------------------


def warm_start_weights(source: str | Path) -> dict[str, torch.Tensor]:
    """Model weights to start a run from: a run's checkpoint (`.pt`) or an exported folder.

    Exported folders (such as sdk/embedded/, the shipped model, to warm-start from) hold
    the model in bf16, in the checkpoint layout of `save_pretrained`, without the auxiliary head;
    transformers reads them back (key renames, tied head) and they are cast to fp32 for training.
    """
    path = Path(source)
    if path.is_dir():
        from transformers import PaliGemmaForConditionalGeneration

        model = PaliGemmaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        return model.state_dict()
    return torch.load(path, weights_only=True)["model"]


class Trainer:
    """Owns tokenizer, model, auxiliary head and optimizer; `train_step()` advances one step,
    `save_checkpoint` / `load_checkpoint` make that resumable."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path | None = None, warm_start: bool = True):
        """`warm_start=False`: ignore cfg.init_from (a resume loads a checkpoint that already holds
        the weights, so the warm-start source need not exist any more)."""
        self.cfg = cfg
        self.fmt = ShapesFormat(n_bins=cfg.n_bins)
        self.tok = _run_tokenizer(Path(run_dir), self.fmt) if run_dir else build_tokenizer(self.fmt)
        vocab = len(self.tok)
        self.model = build_model(
            cfg, vocab, self.tok.convert_tokens_to_ids(IMAGE_TOKEN), self.tok.pad_token_id
        )
        self.n_image_tokens = (cfg.image_size // cfg.patch_size) ** 2
        self.loc_ids = torch.tensor(self.tok.convert_tokens_to_ids(self.fmt.locations.tokens()))
        chat = cfg.task_weights.get("chat")
        self.chat = ChatRenderer(self.tok, self.n_image_tokens, cfg.chat_kinds) if chat else None
        if cfg.init_from and warm_start:
            self.model.load_state_dict(warm_start_weights(cfg.init_from))
        torch.manual_seed(cfg.seed + 1)
        self.aux_head = torch.nn.Linear(cfg.text_width, len(scenes.COLOURS) + len(scenes.SHAPES) + 2 + 1 + 4)
        params = list(self.model.parameters()) + (list(self.aux_head.parameters()) if cfg.aux_weight else [])
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
        self.step = 0

    def train_step(self) -> float:
        batch = batch_for_step(self.step, self.cfg, self.fmt, self.tok, self.n_image_tokens, self.chat)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        self.model.train()
        # Logits only where some row has its suffix (the LM head over image tokens is wasted work).
        first = int((batch.labels != -100).float().argmax(1).min()) - 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
            out = self.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                token_type_ids=batch.token_type_ids,
                pixel_values=batch.pixel_values,
                logits_to_keep=batch.input_ids.shape[1] - first,
            )
        loss = loss_fn(out.logits, batch.labels[:, first:], self.loc_ids, self.cfg)
        if self.cfg.aux_weight:
            loss = loss + self.cfg.aux_weight * aux_loss(
                out.image_outputs.pooler_output, self.aux_head, batch
            )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], 1.0)
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    # ---- checkpoints ----

    def save_checkpoint(self, path: Path) -> None:
        state = {
            "config": asdict(self.cfg),
            "step": self.step,
            "model": self.model.state_dict(),
            "aux_head": self.aux_head.state_dict(),
            "optimizer": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # never leave a half-written checkpoint behind

    def load_checkpoint(self, path: Path) -> None:
        state = torch.load(path, weights_only=True)  # tensors and plain containers only: no code runs
        self.model.load_state_dict(state["model"])
        if "aux_head" in state:
            self.aux_head.load_state_dict(state["aux_head"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])

    def export(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write the Hugging Face folder: config, safetensors, tokenizer, image processor, foveal.json."""
        from transformers import PaliGemmaProcessor, SiglipImageProcessor

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        model = build_model(self.cfg, len(self.tok), self.model.config.image_token_id, self.tok.pad_token_id)
        model.load_state_dict(self.model.state_dict())
        model.to(dtype).save_pretrained(folder)
        (folder / "model.safetensors").chmod(
            0o644
        )  # saved 0600; a shipped package file must be readable by all
        image_processor = SiglipImageProcessor(
            size={"height": self.cfg.image_size, "width": self.cfg.image_size},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
        image_processor.image_seq_length = self.n_image_tokens  # type: ignore[attr-defined]  # read by PaliGemmaProcessor; no class declares it
        image_processor.save_pretrained(folder)  # preprocessor_config.json, for loaders that read it alone
        processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=self.tok, chat_template=CHAT_TEMPLATE)
        processor.save_pretrained(folder)  # chat_template.jinja beside processor_config.json
        _drop_load_options(folder / "tokenizer_config.json")
        self.fmt.save(folder)
        return folder


def _drop_load_options(path: Path) -> None:
    """transformers writes how the run's tokenizer was loaded (is_local, local_files_only) into the
    config it saves; they say nothing of the model, and the shipped folder should not carry them."""
    config = json.loads(path.read_text())
    if any(key in config for key in ("is_local", "local_files_only")):
        config = {k: v for k, v in config.items() if k not in ("is_local", "local_files_only")}
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _run_tokenizer(run: Path, fmt: ShapesFormat):
    """The run's tokenizer: built on first start, then reloaded, so that a resume never depends on
    the current world corpus code."""
    from transformers import PreTrainedTokenizerFast

    folder = run / "tokenizer"
    if folder.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    tok = build_tokenizer(fmt)
    tok.save_pretrained(folder)
    return tok


def train(args: argparse.Namespace) -> Trainer:
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    ckpt = run / "last.pt"
    cfg = _config_for(run, args)
    start = run / args.checkpoint
    trainer = Trainer(cfg, run, warm_start=not start.is_file())
    if start.is_file():
        trainer.load_checkpoint(start)
        print(f"resumed {start} at step {trainer.step}", flush=True)
    elif args.checkpoint != "last.pt":
        raise SystemExit(f"{start} does not exist; pick a checkpoint of the run folder (last.pt, best.pt)")
    log = (run / "log.jsonl").open("a")
    t0, losses = time.time(), []
    end = cfg.steps if args.stop_at is None else min(cfg.steps, args.stop_at)
    while trainer.step < end:
        losses.append(trainer.train_step())
        if trainer.step % args.log_every == 0:
            rec = {
                "step": trainer.step,
                "loss": float(np.mean(losses)),
                "lr": lr_at(trainer.step - 1, cfg),
                "s_per_step": (time.time() - t0) / len(losses),
            }
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            t0, losses = time.time(), []
        if trainer.step % args.ckpt_every == 0 or trainer.step == end:
            trainer.save_checkpoint(ckpt)
        if args.eval_every and trainer.step % args.eval_every == 0:
            _periodic_eval(trainer, run, log)
    if args.export:
        print(f"exported {trainer.export(args.export)}")
    return trainer


def _config_for(run: Path, args: argparse.Namespace) -> TrainConfig:
    """The run's config: saved on first start, reused on resume (only --steps may change)."""
    path = run / "config.json"
    if path.is_file():
        cfg = TrainConfig(**json.loads(path.read_text()))
        cfg.render_sizes = cast(tuple[int, int], tuple(cfg.render_sizes))  # saved from the pair
    else:
        overrides = json.loads(args.config) if args.config else {}
        cfg = TrainConfig(seed=args.seed, **overrides)
    if args.steps is not None:
        cfg.steps = args.steps
    path.write_text(json.dumps(asdict(cfg), indent=2))
    return cfg


def _periodic_eval(trainer: Trainer, run: Path, log) -> None:
    from foveal.training.eval_shapes import BARS, evaluate_model

    folder = trainer.export(run / "export")
    t0 = time.time()
    metrics = evaluate_model(folder, n=128, seed_offset=900_000_000)
    rec = {"step": trainer.step, "eval": metrics, "eval_s": round(time.time() - t0, 1)}
    print(json.dumps(rec), flush=True)
    log.write(json.dumps(rec) + "\n")
    log.flush()
    best = run / "best.json"
    score = sum(metrics[k] for k in BARS)  # every metric with a bar, equally weighted
    if not best.is_file() or score > json.loads(best.read_text())["score"]:
        trainer.save_checkpoint(run / "best.pt")
        best.write_text(json.dumps({"step": trainer.step, "score": score, "eval": metrics}, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m foveal.training.train_shapes", description=__doc__.split("\n")[0]
    )
    p.add_argument("--run", default="runs/shapes", help="run folder for config, checkpoints and logs")
    p.add_argument("--steps", type=int, default=None, help="train until this step (resumes from last.pt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config", default=None, help="JSON overrides of TrainConfig, e.g. '{\"batch_size\": 16}'"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=0, help="held-out mini-eval every N steps (0: never)")
    p.add_argument("--export", default=None, help="write the Hugging Face folder here at the end")
    p.add_argument("--checkpoint", default="last.pt", help="checkpoint of the run folder to start from")
    p.add_argument(
        "--stop-at", type=int, default=None, help="stop (and checkpoint) at this step; the schedule stays --steps'"
    )
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
