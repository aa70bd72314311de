"""`load(path_or_hub_id)`: a checkpoint -> `LoadedModel` (runner, tokenizer, input processor, eos ids, family).

Sources: a local Hugging Face folder (config, safetensors, tokenizer, image processor), a hub id
resolved through huggingface_hub's cache (`hub.py`), or a `.gguf` file: on CPU a llama-architecture
file is read straight from the mapped file (`gguf.py`: fp16 weights for fbgemm's GEMM on x86, or
the int4/int8 weight-only kernels of `quant.py`); other architectures, or CUDA, go through
transformers, which dequantizes. `quantize=` ("int8" | "int4" | "fp16", CPU only) quantizes a
folder's decoder weights at load (`quant.quantize_model`). Nothing from the folder is executed (no trust_remote_code) and nothing is
unpickled (safetensors only). Every check runs before the weights are read, so a bad folder fails
in milliseconds with a message that says what to do.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from foveal.engine.models.attention import ATTN_NAME
from foveal.engine.models.families import Family, ModelLoadError, family_for
from foveal.engine.models.hub import looks_like_hub_id, resolve_hub_id
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES
from foveal.engine.models.processor import InputProcessor
from foveal.engine.models.quant import FP16_UNAVAILABLE, QUANT_MODES, fp16_kernel_available, quantize_model
from foveal.engine.models.runner import HFRunner

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_DEVICES = ("cpu", "cuda")  # the engine's device streams (engine/device.py)


@dataclass(slots=True)
class LoadedModel:
    runner: HFRunner
    tokenizer: Any  # a transformers tokenizer
    processor: InputProcessor  # (text, image=None) -> PromptInputs
    eos_token_ids: tuple[int, ...]
    family: str
    source: str


def load(
    path_or_hub_id: str | os.PathLike,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
    quantize: str | None = None,
    image_options: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load a checkpoint for the engine. device "auto": CUDA when available; dtype None: bf16 on CUDA, fp32 on CPU
    (bf16 under quantize "int8" / "int4", whose kernels want bf16 activations; fp32 under "fp16").

    `image_cache_bytes`: bound of the runner's cache of image features by image key (0: off).
    `quantize`: None, "int8", "int4" or "fp16" (CPU): weight-only quantization of the text decoder's
    linear layers (quant.py; the LM head is int8 under "int8"/"int4", fp16 under "fp16"). A llama
    GGUF file on CPU is always read quantized: None means "fp16" where torch has fbgemm (x86; the
    fastest and most exact layout measured there, quant.py), else its own blocks (Q4 as int4, the
    rest int8); "int4" keeps the file's Q4 blocks as int4 and makes its other layers int4, "int8"
    makes every layer per-row int8; the vocabulary matrix is int8 under both.
    `image_options`: the image processor's resolution bounds where the family has them (Qwen-VL:
    {"min_pixels": .., "max_pixels": ..}); refused for families without.
    """
    if isinstance(image_cache_bytes, bool) or not isinstance(image_cache_bytes, int) or image_cache_bytes < 0:
        raise ModelLoadError(
            f"image_cache_bytes must be an int >= 0 (0 turns the cache off), got {image_cache_bytes!r}"
        )
    check_quantize(quantize)
    dev = resolve_device(device)
    source = str(path_or_hub_id)
    path = Path(source)
    if quantize is None and path.suffix == ".gguf" and dev.type == "cpu" and fp16_kernel_available():
        quantize = "fp16"
    # Weight-only int kernels want bf16 activations: with fp32 ones they took 10-60x longer here
    # (576 x 1536 at batch 1, one thread: int4 0.14 ms with bf16, 1.7 ms with fp32; quant.py).
    # fbgemm's fp16 GEMM takes float32 activations only.
    int_kernels = quantize in ("int8", "int4") or (quantize is None and path.suffix == ".gguf" and dev.type == "cpu")
    torch_dtype = torch.bfloat16 if dtype is None and int_kernels else resolve_dtype(dtype, dev)
    if quantize == "fp16" and torch_dtype != torch.float32:
        raise ModelLoadError(f"quantize='fp16' multiplies float32 activations; leave dtype unset (got {dtype!r})")
    if quantize == "fp16" and not fp16_kernel_available():
        raise ModelLoadError(FP16_UNAVAILABLE)
    if quantize is not None and dev.type != "cpu":
        raise ModelLoadError(
            f"quantize={quantize!r} uses torch's CPU weight-only kernels; on {dev.type} load without quantize "
            "(dtype='bfloat16' halves the weights)"
        )
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no such GGUF file: {path}")
        if image_options:
            raise ModelLoadError(
                "image_options apply to Qwen-VL folders; a .gguf file has no image processor"
            )
        return _load_gguf(path, dev, torch_dtype, image_cache_bytes, quantize)
    if not path.exists():
        if not looks_like_hub_id(source):
            raise ModelLoadError(f"{source!r} is neither a folder nor a hub id of the form 'org/name'")
        path = resolve_hub_id(source)
    return _load_folder(path, dev, torch_dtype, source, image_cache_bytes, quantize, image_options)


def check_quantize(quantize: object) -> None:
    if quantize is not None and quantize not in QUANT_MODES:
        raise ModelLoadError(
            f"quantize={quantize!r} is not supported; use None (the checkpoint's own weights), 'int8', 'int4' or 'fp16'"
        )


def resolve_device(device: str | torch.device) -> torch.device:
    """Device "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"; anything else is refused
    here, in one line, before any weights are read (the engine drives CPU and CUDA runners only)."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ModelLoadError(
            f"device must be a str or torch.device ('auto', 'cpu', 'cuda', 'cuda:N'), got {device!r}"
        )
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's own message lists twenty device types foveal cannot run on
        raise ModelLoadError(
            f"device={device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type not in SUPPORTED_DEVICES:
        raise ModelLoadError(
            f"device={device!r} is not supported: foveal runs models on 'cpu' or 'cuda' ('auto' picks CUDA "
            "when torch sees one); use one of those"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device={device!r} was asked for but torch sees no CUDA device; use device='cpu'"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA device(s), numbered from 0; "
            "use one of them"
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_folder(path: Path) -> None:
    """Refuse folders we cannot load safely, before reading any weights."""
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a folder; pass a Hugging Face checkpoint folder or a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json; a checkpoint folder needs config.json and *.safetensors"
        )
    names = [p.name for p in path.iterdir()]
    if not any(n.endswith(".safetensors") for n in names):
        pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise ModelLoadError(
                f"{path} has only pickled weights ({', '.join(sorted(pickles))}); foveal never unpickles. "
                "Convert once, in an environment you trust: "
                "`python -c \"import transformers as t; m = t.AutoModel.from_pretrained('IN'); "
                "m.save_pretrained('OUT')\"` (writes model.safetensors), then load OUT."
            )
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    if not any(n in names for n in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save the tokenizer with the model"
        )


def check_attention(text_config: dict) -> None:
    """Refuse attention variants the paged attention does not implement (they would run, wrongly)."""
    for key in ("attn_logit_softcapping", "sliding_window"):
        if key == "sliding_window" and text_config.get("use_sliding_window") is False:
            continue  # Qwen2-style configs name a window they do not use
        if text_config.get(key) is not None:
            raise ModelLoadError(
                f"the text model sets {key}={text_config[key]!r}, which foveal's paged attention does not "
                "implement yet (Gemma 2/3, Mistral-style models); use a checkpoint without it"
            )


def _load_folder(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    source: str,
    image_cache_bytes: int,
    quantize: str | None = None,
    image_options: dict[str, Any] | None = None,
) -> LoadedModel:
    check_folder(path)
    # The architecture is checked from the raw JSON: AutoConfig would ask for trust_remote_code first.
    raw = json.loads((path / "config.json").read_text())
    from foveal.engine.models import moondream  # lazily: it imports this module

    if moondream.is_moondream(raw):  # foveal's own implementation, no transformers class
        for name, value in (("quantize", quantize), ("image_options", image_options)):
            if value:
                raise ModelLoadError(f"{name} is not supported for Moondream 2 (its own implementation); leave it unset")
        return moondream.load_folder(path, device, dtype, source, image_cache_bytes)
    family, arch = family_for(raw.get("architectures"))
    adapter = _adapter(family)
    if image_options and adapter is None:
        raise ModelLoadError(
            f"image_options are not supported for {family.name}; its image processor has fixed sizes"
        )
    check_attention(raw.get("text_config") or raw)
    if adapter is not None:
        adapter.check_config(raw, path)
    if family.has_vision and not any(
        (path / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")
    ):
        raise ModelLoadError(
            f"{path} has no preprocessor_config.json; save the image processor with the model"
        )
    if adapter is not None:
        hf_processor, tokenizer = adapter.load_processor(family, path, image_options)
    else:
        hf_processor, tokenizer = _load_processor(family, path)
    model = getattr(transformers, arch).from_pretrained(
        path, dtype=dtype, attn_implementation=_attn_implementation(family), use_safetensors=True
    )
    if quantize is not None:
        try:
            quantize_model(model, quantize)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    return _assemble(model.to(device), family, tokenizer, hf_processor, source, image_cache_bytes)


def _adapter(family: Family) -> Any:
    """The module with a family's own loading code (Family.adapter), or None."""
    return importlib.import_module(family.adapter) if family.adapter else None


def _load_gguf(
    path: Path, device: torch.device, dtype: torch.dtype, image_cache_bytes: int, quantize: str | None
) -> LoadedModel:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a .gguf file needs gguf: pip install 'foveal[bench]'")
    header = check_gguf(path)  # a broken file is refused first, whatever else is missing
    from foveal.engine.models import gguf as direct

    if device.type == "cpu" and direct.is_direct(header):
        config = direct.llama_config(path, header)
        config._attn_implementation = ATTN_NAME
        family, _ = family_for(config.architectures)
        # The tokenizer's conversion is Python (it holds the GIL); unpacking and packing weights
        # mostly release it, so the two overlap.
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(direct.tokenizer, header)
            model = direct.load_quantized(header, config, dtype, quantize)
            return _assemble(model, family, tokenizer.result(), None, str(path), image_cache_bytes)
    if importlib.util.find_spec("accelerate") is None:
        raise ModelLoadError("loading this .gguf file needs accelerate: pip install 'foveal[bench]'")
    kwargs = {"gguf_file": path.name}
    config = transformers.AutoConfig.from_pretrained(path.parent, **kwargs)
    family, arch = family_for(
        getattr(config, "architectures", None) or [f"{config.model_type.capitalize()}ForCausalLM"]
    )
    model = getattr(transformers, arch).from_pretrained(
        path.parent, dtype=dtype, attn_implementation=ATTN_NAME, **kwargs
    )
    if quantize is not None:
        quantize_model(model, quantize)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    return _assemble(model.to(device), family, tokenizer, None, str(path), image_cache_bytes)


def check_gguf(path: Path) -> Any:
    """Refuse a truncated or corrupt GGUF file in one line, before anything else parses it; returns its header.

    The header parse maps the file and reads its metadata and tensor table (no tensor data); a file
    cut short fails there with a bare struct.error or ValueError, or, cut inside the tensor data,
    parses but ends before its last tensor.
    """
    from foveal.engine.models.gguf import read_header

    size = path.stat().st_size
    try:
        header = read_header(path)
    except Exception as error:  # struct.error, ValueError, IndexError, UnicodeDecodeError: whatever the cut hits
        detail = f"{type(error).__name__}: {error}".splitlines()[0]
        raise ModelLoadError(
            f"{path} ({size} bytes) is not a readable GGUF file, probably truncated or corrupt ({detail}); "
            "download it again"
        ) from None
    end = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=0)
    if end > size:
        raise ModelLoadError(
            f"{path} is truncated: its tensors end at byte {end} but the file has {size}; download it again"
        )
    return header


def _load_processor(family: Family, path: Path) -> tuple[Any, Any]:
    if not family.has_vision:
        return None, transformers.AutoTokenizer.from_pretrained(path)
    processor = getattr(transformers, family.processor_class).from_pretrained(path)
    return processor, processor.tokenizer


def _attn_implementation(family: Family) -> str | dict[str, str]:
    if not family.has_vision:
        return ATTN_NAME
    return {"": ATTN_NAME, "text_config": ATTN_NAME, "vision_config": "sdpa"}


def _assemble(
    model: Any, family: Family, tokenizer: Any, hf_processor: Any, source: str, image_cache_bytes: int
) -> LoadedModel:
    adapter = _adapter(family)
    if adapter is not None:
        runner = adapter.make_runner(model, family, image_cache_bytes)
    else:
        runner = HFRunner(model, family, image_cache_bytes=image_cache_bytes)
    if len(tokenizer) > runner.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {runner.vocab_size}: "
            "they do not belong together; save the checkpoint's own tokenizer into the folder"
        )
    image_token_id = getattr(model.config, "image_token_id", None) if family.has_vision else None
    if adapter is not None:
        processor = adapter.make_input_processor(family, tokenizer, hf_processor, model, runner)
    else:
        device, dtype = runner.device, runner.dtype
        processor = InputProcessor(family, tokenizer, hf_processor, device, dtype, image_token_id)
    return LoadedModel(runner, tokenizer, processor, _eos_ids(model, tokenizer), family.name, source)


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    found: list[int] = []
    for value in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config.get_text_config(), "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and token not in found:
                found.append(int(token))
    return tuple(found)
