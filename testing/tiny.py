"""Tiny random checkpoints of each supported family, for tests, notebooks and benchmarks; offline.

`build(family, folder)` writes a checkpoint folder the way a user's would look: config.json with
random weights (model.safetensors), a byte-level BPE tokenizer trained here on a small corpus, and
for vision families the family's own processor (image processor + placeholder expansion). Nothing
is downloaded, and each build is deterministic (seeded). The folders load through
`foveal.engine.models.load` / `foveal.load` exactly as real checkpoints do; their weights are
random, so they check plumbing and parity (`parity.py`), not answers.

Also here: the inputs the checks use (`PROMPTS` and `images()`, from tiny_inputs.py, which the
other tiny_*.py builders share; `family_prompts(loaded)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from foveal.engine.models.processor import PromptInputs
from foveal.testing import tiny_qwen  # Qwen2.5-VL and Qwen3-VL: Qwen's tokenizer layout, M-RoPE prompts
from foveal.testing.tiny_inputs import CORPUS, PROMPTS, TEXT, images

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<image>"]



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


def save(model: Any, folder: Path, tokenizer: Any = None, processor: Any = None) -> Path:
    """Save a model with its processor (which saves its tokenizer) or, for text-only models, its tokenizer."""
    model.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    elif tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


# ---- tiny random checkpoints, one builder per family: (folder) -> folder --------------------------------------

VISION: dict[str, Any] = dict(
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
    image_processor.image_seq_length = 4  # type: ignore[attr-defined]  # read by PaliGemmaProcessor; (28 / 14) ** 2 patches
    processor = tf.PaliGemmaProcessor(
        image_processor=image_processor, tokenizer=tok
    )  # adds <loc>/<seg> tokens
    torch.manual_seed(0)
    text = tf.GemmaConfig(vocab_size=len(tok), **{**TEXT, "num_key_value_heads": 1, "head_dim": 16})
    # (configs keep extra keyword arguments as attributes; their typed signatures do not list them)
    vision = tf.SiglipVisionConfig(**VISION, projection_dim=TEXT["hidden_size"])  # type: ignore[call-arg]
    config = tf.PaliGemmaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=cast(int, tok.convert_tokens_to_ids("<image>")),
        projection_dim=TEXT["hidden_size"],
        hidden_size=TEXT["hidden_size"],
        architectures=["PaliGemmaForConditionalGeneration"],
        **_special_ids(tok),
    )
    return save(tf.PaliGemmaForConditionalGeneration(config), folder, processor=processor)


def build_idefics3(folder: Path) -> Path:
    return _build_idefics3_like(
        folder,
        Idefics3ImageProcessorPil,
        tf.Idefics3Config,
        tf.Idefics3VisionConfig,
        tf.Idefics3ForConditionalGeneration,
    )


def build_smolvlm(folder: Path) -> Path:
    """SmolVLM's architecture and image processor; the folder names SmolVLMProcessor, as real ones do."""
    _build_idefics3_like(
        folder,
        tf.SmolVLMImageProcessorPil,
        tf.SmolVLMConfig,
        tf.SmolVLMVisionConfig,
        tf.SmolVLMForConditionalGeneration,
    )
    names = folder / "processor_config.json"
    names.write_text(names.read_text().replace('"Idefics3Processor"', '"SmolVLMProcessor"'))
    return folder


def _build_idefics3_like(folder: Path, image_processor_cls, config_cls, vision_cls, model_cls) -> Path:
    """Idefics3 and SmolVLM are one architecture under two sets of class names."""
    tok = train_tokenizer()
    image_processor = image_processor_cls(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=1)
    torch.manual_seed(0)
    config = config_cls(
        vision_config=vision_cls(**VISION).to_dict(),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,  # pixel shuffle: 2x2 patches -> one token
        architectures=[model_cls.__name__],
        **_special_ids(tok),
    )
    return save(model_cls(config), folder, processor=processor)


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
        image_token_index=cast(int, tok.convert_tokens_to_ids("<image>")),
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
    "qwen2_5_vl": tiny_qwen.build_qwen2_5_vl,
    "qwen3_vl": tiny_qwen.build_qwen3_vl,
}


def build(family: str, folder: str | Path) -> Path:
    """Write the tiny random checkpoint of `family` (a key of BUILDERS) to `folder`; returns the folder."""
    if family not in BUILDERS:
        raise ValueError(f"no tiny checkpoint for {family!r}; choose one of {', '.join(BUILDERS)}")
    return BUILDERS[family](Path(folder))


def family_prompts(loaded: Any) -> list[PromptInputs]:
    """Five prompts of different lengths (with five different images for vision families); vision
    families that can also take a text-only prompt get a sixth one without an image. Qwen-VL: chat
    prompts with images of four sizes, one prompt with two images, one without (tiny_qwen.prompts)."""
    if loaded.name in tiny_qwen.FAMILIES:
        return tiny_qwen.prompts(loaded)
    if loaded.runner.arch.processor_class is None:
        return [loaded.processor(p) for p in PROMPTS]
    prompts = [loaded.processor(p, im) for p, im in zip(PROMPTS, images(), strict=True)]
    if not loaded.runner.arch.image_required:
        prompts.append(loaded.processor("a blue square"))
    return prompts
