"""Shared helpers for the model tests: a locally trained tokenizer, tiny random checkpoints, a greedy loop.

Nothing is downloaded: each family's checkpoint is built from a small config with random weights,
saved with its tokenizer and processor to a temporary folder, and loaded back through
`foveal.engine.models.load` exactly as a user's folder would be.

`greedy` drives a runner the way the engine does (until the engine lands): one varlen prefill
launch for all prompts, then batched decode launches, with pages handed out in a shuffled order
so that sequences' pages interleave in the pool.
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from foveal.engine.models.processor import PromptInputs
from foveal.engine.runner import ForwardBatch

CORPUS = [
    "a red circle left of a blue square",
    "describe the image in one sentence",
    "how many shapes are there? answer with a number",
    "the quick brown fox jumps over the lazy dog",
    "detect every green triangle and give its box",
    "point at the yellow star near the top right corner",
] * 20
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<image>"]

PROMPTS = [
    "a",
    "red circle",
    "describe the image in one sentence",
    "how many shapes are there? answer with a number please",
    "the quick brown fox jumps over the lazy dog and a blue square detect every green triangle",
]


def train_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on a tiny corpus; it adds <bos> in front of every text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def images(n: int = 5) -> list[Image.Image]:
    """Deterministic images of different sizes and aspect ratios."""
    rng = np.random.default_rng(0)
    sizes = [(40, 30), (64, 64), (25, 80), (90, 45), (33, 33), (50, 70)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:n]]


@dataclass
class GreedyResult:
    tokens: list[list[int]]
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # per sequence, per step: [vocab]


def make_batch(
    items: list[tuple[list[int], int, list[int], dict | None]], page_size: int, device
) -> ForwardBatch:
    """items: (query token ids, position of the first one, page table, extras) per sequence."""
    ids, pos, starts, ctx, slots = [], [], [0], [], []
    width = max(len(t) for _, _, t, _ in items)
    tables = []
    for query, start, table, _ in items:
        ids += query
        pos += range(start, start + len(query))
        starts.append(starts[-1] + len(query))
        ctx.append(start + len(query))
        slots += [table[p // page_size] * page_size + p % page_size for p in range(start, start + len(query))]
        tables.append(table + [-1] * (width - len(table)))
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=as_t(ids, torch.int64),
        positions=as_t(pos, torch.int64),
        query_start=as_t(starts, torch.int32),
        context_lens=as_t(ctx, torch.int32),
        block_tables=as_t(tables, torch.int32),
        slot_mapping=as_t(slots, torch.int64),
        max_query_len=max(len(q) for q, _, _, _ in items),
        max_context_len=max(ctx),
        extras=[e for _, _, _, e in items],
    )


def greedy(
    runner, prompts: list[PromptInputs], max_new_tokens: int, eos_ids=(), page_size: int = 4
) -> GreedyResult:
    """Greedy decoding of all prompts together: one prefill launch, then one decode launch per step."""
    need = [math.ceil((len(p.token_ids) + max_new_tokens) / page_size) for p in prompts]
    pool = list(range(sum(need) + 2))
    random.Random(0).shuffle(pool)
    runner.allocate_kv(len(pool), page_size)
    tables, at = [], 0
    for n in need:
        tables.append(pool[at : at + n])
        at += n
    result = GreedyResult(tokens=[[] for _ in prompts], logits=[[] for _ in prompts])
    items = [(p.token_ids, 0, t, p.extras) for p, t in zip(prompts, tables, strict=True)]
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        logits = runner.forward(make_batch(items, page_size, runner.device)).cpu()
        still, items_next = [], []
        for row, seq in enumerate(active):
            token = int(logits[row].argmax())
            result.tokens[seq].append(token)
            result.logits[seq].append(logits[row])
            if token in eos_ids or len(result.tokens[seq]) == max_new_tokens:
                continue
            still.append(seq)
            position = len(prompts[seq].token_ids) + len(result.tokens[seq]) - 1
            items_next.append(([token], position, tables[seq], None))
        active, items = still, items_next
        if not active:
            break
    return result


@pytest.fixture(scope="session")
def helpers():
    """This module: tests run with --import-mode=importlib, so they reach these helpers through a fixture."""
    return sys.modules[__name__]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny checkpoint folder, built once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def save(model, folder: Path, tokenizer=None, processor=None) -> Path:
    model.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    elif tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def reference_greedy(
    model, prompt: PromptInputs, family, max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own `generate` (greedy, batch of one) on the same prompt: tokens and per-step logits."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.token_ids], device=device)
    kwargs = {}
    if prompt.extras is not None:
        kwargs = {key: prompt.extras[key].to(device) for key in family.image_keys}
        if family.prefix_attention:
            types = [0] * prompt.extras["prefix_len"] + [1] * (
                len(prompt.token_ids) - prompt.extras["prefix_len"]
            )
            kwargs["token_type_ids"] = torch.tensor([types], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return tokens, [step[0].float().cpu() for step in out.logits]


def parity(
    loaded, reference_model, prompts: list[PromptInputs], max_new_tokens: int = 8
) -> tuple[float, bool]:
    """(max |logit difference| over all steps and prompts, all greedy tokens equal) of foveal vs transformers."""
    family = loaded.runner.family
    ours = greedy(loaded.runner, prompts, max_new_tokens, loaded.eos_token_ids)
    worst, equal = 0.0, True
    for seq, prompt in enumerate(prompts):
        tokens, logits = reference_greedy(reference_model, prompt, family, max_new_tokens)
        equal &= tokens == ours.tokens[seq]
        for a, b in zip(ours.logits[seq], logits, strict=False):
            worst = max(worst, float((a - b).abs().max()))
    return worst, equal


# ---- tiny random checkpoints, one builder per family: (folder) -> folder --------------------------------------

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaked logits: greedy ties would make token equality a coin toss
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def _special_ids(tok) -> dict:
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def build_llama(folder: Path) -> Path:
    tok = train_tokenizer()
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=len(tok), **TEXT, **_special_ids(tok), architectures=["LlamaForCausalLM"]
    )
    return save(tf.LlamaForCausalLM(config), folder, tokenizer=tok)


def build_gemma(folder: Path) -> Path:
    tok = train_tokenizer()
    torch.manual_seed(0)
    text = {**TEXT, "num_key_value_heads": 1, "head_dim": 16}
    config = tf.GemmaConfig(
        vocab_size=len(tok), **text, **_special_ids(tok), architectures=["GemmaForCausalLM"]
    )
    return save(tf.GemmaForCausalLM(config), folder, tokenizer=tok)


def build_paligemma(folder: Path) -> Path:
    tok = train_tokenizer()
    image_processor = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    image_processor.image_seq_length = 4  # (28 / 14) ** 2 patches
    processor = tf.PaliGemmaProcessor(
        image_processor=image_processor, tokenizer=tok
    )  # adds <loc>/<seg> tokens
    torch.manual_seed(0)
    text = tf.GemmaConfig(vocab_size=len(tok), **{**TEXT, "num_key_value_heads": 1, "head_dim": 16})
    vision = tf.SiglipVisionConfig(**VISION, projection_dim=TEXT["hidden_size"])
    config = tf.PaliGemmaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        projection_dim=TEXT["hidden_size"],
        hidden_size=TEXT["hidden_size"],
        architectures=["PaliGemmaForConditionalGeneration"],
        **_special_ids(tok),
    )
    return save(tf.PaliGemmaForConditionalGeneration(config), folder, processor=processor)


def build_idefics3(folder: Path) -> Path:
    tok = train_tokenizer()
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=1)
    torch.manual_seed(0)
    config = tf.Idefics3Config(
        vision_config=tf.Idefics3VisionConfig(**VISION).to_dict(),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,  # pixel shuffle: 2x2 patches -> one token
        architectures=["Idefics3ForConditionalGeneration"],
        **_special_ids(tok),
    )
    return save(tf.Idefics3ForConditionalGeneration(config), folder, processor=processor)


def build_smolvlm(folder: Path) -> Path:
    """SmolVLM's architecture and image processor; the folder names SmolVLMProcessor, as real ones do."""
    tok = train_tokenizer()
    image_processor = tf.SmolVLMImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=1)
    torch.manual_seed(0)
    config = tf.SmolVLMConfig(
        vision_config=tf.SmolVLMVisionConfig(**VISION).to_dict(),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        architectures=["SmolVLMForConditionalGeneration"],
        **_special_ids(tok),
    )
    save(tf.SmolVLMForConditionalGeneration(config), folder, processor=processor)
    names = folder / "processor_config.json"
    names.write_text(names.read_text().replace('"Idefics3Processor"', '"SmolVLMProcessor"'))
    return folder


def build_llava(folder: Path) -> Path:
    tok = train_tokenizer()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    torch.manual_seed(0)
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**VISION).to_dict(),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        architectures=["LlavaForConditionalGeneration"],
        **_special_ids(tok),
    )
    return save(tf.LlavaForConditionalGeneration(config), folder, processor=processor)


BUILDERS = {
    "llama": build_llama,
    "gemma": build_gemma,
    "paligemma": build_paligemma,
    "idefics3": build_idefics3,
    "smolvlm": build_smolvlm,
    "llava": build_llava,
}


def reference_model(folder: Path):
    """transformers' own model class for the folder, with its default (SDPA) attention."""
    config = tf.AutoConfig.from_pretrained(folder)
    return getattr(tf, config.architectures[0]).from_pretrained(folder).eval()


def family_prompts(loaded) -> list[PromptInputs]:
    """Five prompts of different lengths (with five different images for vision families); vision
    families that can also take a text-only prompt get a sixth one without an image."""
    if loaded.runner.family.processor_class is None:
        return [loaded.processor(p) for p in PROMPTS]
    prompts = [loaded.processor(p, im) for p, im in zip(PROMPTS, images(), strict=True)]
    if loaded.family != "paligemma":
        prompts.append(loaded.processor("a blue square"))
    return prompts
