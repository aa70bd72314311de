"""Loading a checkpoint onto the engine's building blocks: options, sources, transformers models, GGUF files.

A family plugin (`foveal.families`) decides what a checkpoint is; this module does the generic part
of loading it: options checked and resolved (`resolve_options`), a source resolved to a local path
(`resolve_source`: a folder, a .gguf file, or a hub id already in the local cache, `hub.py`), the
folder's safety checks (`read_config`: config.json, safetensors only, a tokenizer), a transformers
model with its attention on foveal's paged attention (`load_transformers`, `quantize=` "int8" |
"int4" | "fp16" on CPU through `quant.quantize_model`), a .gguf file (`load_gguf`: on CPU a llama
file is read straight from the mapped file, `gguf.py`, its prepared weights kept for the next load
by `weight_cache.py`; other architectures, or CUDA, through transformers, which dequantizes), and
the runner + input processor + eos ids (`assemble`).
Nothing from a folder is executed (no trust_remote_code) and nothing is unpickled (safetensors
only). Every check runs before the weights are read, so a bad folder fails in milliseconds with a
message that says what to do.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.attention import hf_attention
from foveal.engine.models.hub import looks_like_hub_id, resolve_hub_id
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES
from foveal.engine.models.processor import InputProcessor
from foveal.engine.models.quant import FP16_UNAVAILABLE, QUANT_MODES, fp16_kernel_available, quantize_model
from foveal.engine.models.runner import HFRunner
from foveal.engine.models.traced import DecodeGraphs

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_DEVICES = ("cpu", "cuda")  # the engine's device streams (engine/device.py)


@dataclass(slots=True)
class LoadedModel:
    """A checkpoint on the engine's building blocks: what a family plugin is built from."""

    runner: Any  # an engine ModelRunner (HFRunner or a family's own)
    tokenizer: Any  # a transformers tokenizer
    processor: Any  # (prompt, images=None, image_key=None) -> PromptInputs
    eos_token_ids: tuple[int, ...]
    source: str


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """`load`'s options, checked and resolved before any weights are read."""

    device: torch.device
    dtype: torch.dtype
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES
    quantize: str | None = None
    image_options: dict[str, Any] | None = None
    # the revision the caller pinned (a hub branch, tag or commit); families that can tell a folder's
    # revision check it (Moondream 2), the others refuse a pin on a local folder (families.load)
    revision: str | None = None
    # "torch" (engine/models/runner.py), "ggml" (ggml.py: a .gguf file on llama.cpp's kernels), or
    # "auto": ggml, else torch where llama.cpp cannot load the file (resolve_runner)
    runner: str = "torch"


RUNNERS = ("auto", "torch", "ggml")


def resolve_options(
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
    quantize: str | None = None,
    image_options: dict[str, Any] | None = None,
    gguf: bool = False,
    revision: str | None = None,
    runner: str = "auto",
) -> LoadOptions:
    """Check and resolve load options. device "auto": CUDA when available; dtype None: bf16 on CUDA, fp32
    on CPU (bf16 under quantize "int8" / "int4", whose kernels want bf16 activations; fp32 under "fp16").
    `gguf`: the source is a .gguf file, which on CPU is always read quantized: None means, where torch
    has fbgemm (x86), float32 activations with the file's Q4 blocks as int4 for few-row launches and
    fp16 for the rest (gguf.load_quantized), else its own blocks (Q4 as int4, the rest int8) in bf16."""
    if isinstance(image_cache_bytes, bool) or not isinstance(image_cache_bytes, int) or image_cache_bytes < 0:
        raise ModelLoadError(
            f"image_cache_bytes must be an int >= 0 (0 turns the cache off), got {image_cache_bytes!r}"
        )
    check_quantize(quantize)
    dev = resolve_device(device)
    split = quantize is None and gguf and dev.type == "cpu" and fp16_kernel_available()
    if split and dtype not in (None, "float32", torch.float32):
        raise ModelLoadError(
            f"a .gguf file's default kernels multiply float32 activations; leave dtype unset (got {dtype!r}) "
            "or pass quantize='int8' / 'int4' for bf16"
        )
    # Weight-only int kernels want bf16 activations (with fp32 ones they are an order of magnitude
    # slower, quant.py); fbgemm's fp16 GEMM takes float32 activations only, and so does the GGUF
    # default (quant.SplitLinear: bf16 only inside its int4 kernel).
    own_blocks = quantize is None and gguf and dev.type == "cpu" and not split
    int_kernels = quantize in ("int8", "int4") or own_blocks
    torch_dtype = torch.bfloat16 if dtype is None and int_kernels else resolve_dtype(dtype, dev)
    if quantize == "fp16" and torch_dtype != torch.float32:
        raise ModelLoadError(
            f"quantize='fp16' multiplies float32 activations; leave dtype unset (got {dtype!r})"
        )
    if quantize == "fp16" and not fp16_kernel_available():
        raise ModelLoadError(FP16_UNAVAILABLE)
    if quantize is not None and dev.type != "cpu":
        raise ModelLoadError(
            f"quantize={quantize!r} uses torch's CPU weight-only kernels; on {dev.type} load without quantize "
            "(dtype='bfloat16' halves the weights)"
        )
    if gguf and image_options:
        raise ModelLoadError("image_options apply to Qwen-VL folders; a .gguf file has no image processor")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ModelLoadError(f"revision must be a branch, tag or commit name (a non-empty str), got {revision!r}")
    if revision is not None and gguf:
        raise ModelLoadError("revision= pins a hub repository's snapshot; a .gguf file is read as it is")
    chosen = resolve_runner(runner, gguf, dev, dtype, quantize)
    return LoadOptions(
        dev, torch_dtype, image_cache_bytes, quantize, dict(image_options) if image_options else None, revision,
        chosen,
    )


def resolve_runner(runner: object, gguf: bool, device: torch.device, dtype: object, quantize: str | None) -> str:
    """"auto": ggml for a .gguf file on CPU when llama-cpp-python is installed and no quantize or
    dtype asks for torch's kernels (kept "auto": load_gguf falls back to torch, with a warning,
    where llama.cpp cannot load the file); else torch. "ggml" where it cannot run is refused with why."""
    from foveal.engine.models import ggml

    if runner not in RUNNERS:
        raise ModelLoadError(f"runner must be one of {', '.join(map(repr, RUNNERS))}, got {runner!r}")
    fits = gguf and device.type == "cpu" and quantize is None and dtype is None
    if runner == "auto":
        return "auto" if fits and ggml.available() else "torch"
    if runner == "ggml" and not fits:
        raise ModelLoadError(
            "runner='ggml' runs a .gguf file's own weights on the CPU: "
            + ("the source is not a .gguf file" if not gguf else f"leave device='cpu', quantize and dtype unset "
               f"(got device={device.type!r}, quantize={quantize!r}, dtype={dtype!r}), or use runner='torch'")
        )
    if runner == "ggml" and not ggml.available():
        raise ModelLoadError(f"runner='ggml' needs llama-cpp-python: {ggml.INSTALL}")
    return str(runner)


def resolve_source(source: str | os.PathLike, revision: str | None = None) -> Path:
    """The local path of a checkpoint: a .gguf file, a folder, or a hub id (at `revision`) in the local cache."""
    text = str(source)
    path = Path(text)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no such GGUF file: {path}")
        return path
    if path.exists():
        return path
    if not looks_like_hub_id(text):
        raise ModelLoadError(f"{text!r} is neither a folder nor a hub id of the form 'org/name'")
    return resolve_hub_id(text, revision=revision)


def read_config(path: Path) -> dict:
    """config.json of a checkpoint folder, read as JSON (AutoConfig would ask for trust_remote_code first),
    after the folder's checks."""
    check_folder(path)
    return json.loads((path / "config.json").read_text())


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


IMAGE_PROCESSOR_FILES = "preprocessor_config.json, or processor_config.json with an image_processor entry"


def image_processor_settings(path: Path) -> dict | None:
    """The image processor's settings as transformers reads them: preprocessor_config.json, else the
    `image_processor` entry of processor_config.json (where transformers 5 saves a processor's image
    processor); None when the folder has neither."""
    alone = path / "preprocessor_config.json"
    if alone.is_file():
        return _json_object(alone)
    joint = path / "processor_config.json"
    if joint.is_file():
        nested = _json_object(joint).get("image_processor")
        if isinstance(nested, dict):
            return nested
    return None


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path} is not readable JSON: {error}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} holds {type(value).__name__}, not a JSON object; save the processor again")
    return value


def check_vision_files(path: Path) -> None:
    if image_processor_settings(path) is None:
        raise ModelLoadError(
            f"{path} has no image processor settings ({IMAGE_PROCESSOR_FILES}); save the image processor with the model"
        )


def load_transformers(
    path: Path,
    raw: dict,
    arch: Architecture,
    class_name: str,
    options: LoadOptions,
    processor: Callable[[], tuple[Any, Any]] | None = None,
) -> tuple[Any, Any, Any]:
    """(model on the device, hf processor or None, tokenizer) of a folder (its config.json read as
    `raw`) whose model is transformers' `class_name`, its attention on foveal's paged attention.
    `processor`: what builds the (hf processor, tokenizer) pair where the family builds its own,
    called after the folder's checks; default: the architecture's processor class (or the tokenizer)."""
    check_attention(raw.get("text_config") or raw)
    if arch.has_vision:
        check_vision_files(path)
    hf_processor, tokenizer = processor() if processor is not None else _load_processor(arch, path)
    model = getattr(transformers, class_name).from_pretrained(
        path, dtype=options.dtype, attn_implementation=_attn_implementation(arch), use_safetensors=True
    )
    if options.quantize is not None:
        try:
            quantize_model(model, options.quantize)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    return model.to(options.device), hf_processor, tokenizer


def load_gguf(
    path: Path, options: LoadOptions, arch_for: Callable[[list[str]], tuple[Architecture, str]]
) -> tuple[LoadedModel, Architecture]:
    """A .gguf file: on CPU a llama file is read straight from the mapped file (gguf.py); others, or CUDA,
    through transformers, which dequantizes. `arch_for(architectures)`: the family's architecture."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a .gguf file needs gguf: pip install -e '.[bench]' in foveal's clone")
    header = check_gguf(path)  # a broken file is refused first, whatever else is missing
    from foveal.engine.models import gguf as direct

    device, dtype, quantize = options.device, options.dtype, options.quantize
    if options.runner == "ggml":
        return _load_ggml(path, header, arch_for, options)
    if options.runner == "auto":
        try:
            return _load_ggml(path, header, arch_for, options)
        except ModelLoadError as error:  # an architecture this llama.cpp lacks: torch's kernels, said
            warnings.warn(f"{error}; running it on torch's kernels instead", stacklevel=4)
    if device.type == "cpu" and direct.is_direct(header):
        config = direct.llama_config(path, header)
        assert config.architectures is not None  # llama_config sets it
        arch, _ = arch_for(config.architectures)
        model, tokenizer = _load_direct(path, header, config, options)
        loaded = assemble(model, arch, tokenizer, None, str(path), options)
        _prepare_decode(loaded.runner)
        return loaded, arch
    if importlib.util.find_spec("accelerate") is None:
        raise ModelLoadError("loading this .gguf file needs accelerate: pip install -e '.[bench]' in foveal's clone")
    kwargs = {"gguf_file": path.name}
    config = transformers.AutoConfig.from_pretrained(path.parent, **kwargs)
    arch, class_name = arch_for(
        getattr(config, "architectures", None) or [f"{config.model_type.capitalize()}ForCausalLM"]
    )
    model = getattr(transformers, class_name).from_pretrained(
        path.parent, dtype=dtype, attn_implementation=hf_attention(), **kwargs
    )
    if quantize is not None:
        quantize_model(model, quantize)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    return assemble(model.to(device), arch, tokenizer, None, str(path), options), arch


def _load_ggml(
    path: Path, header: Any, arch_for: Callable[[list[str]], tuple[Architecture, str]], options: LoadOptions
) -> tuple[LoadedModel, Architecture]:
    """A .gguf file on llama.cpp's kernels (ggml.py): llama.cpp reads the weights, foveal only the
    tokenizer (the same one the torch path builds), so the weights are held once."""
    from foveal.engine.models import gguf as direct
    from foveal.engine.models.ggml import GgmlRunner

    meta = direct.read_metadata(header)
    name = str(meta.get("general.architecture", "?"))
    # the file's own architecture where the family's table has it; any other text architecture
    # llama.cpp runs prompts as a llama does (the file's own chat template, no vision)
    arch, _ = arch_for([f"{name.capitalize()}ForCausalLM", "LlamaForCausalLM"])
    # llama.cpp's load runs with the GIL released (ctypes), the tokenizer's conversion holds it: the two overlap
    with ThreadPoolExecutor(1) as pool:
        made = pool.submit(_ggml_tokenizer, path, header)
        runner = GgmlRunner(path)
        tokenizer = made.result()
    if len(tokenizer) > runner.vocab_size:
        raise ModelLoadError(
            f"{path}'s tokenizer has {len(tokenizer)} tokens but llama.cpp's vocabulary {runner.vocab_size}"
        )
    processor = InputProcessor(arch, tokenizer, None, runner.device, runner.dtype, None)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    found = [int(eos)] if eos is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in found:
        found.append(int(tokenizer.eos_token_id))
    return LoadedModel(runner, tokenizer, processor, tuple(found), str(path)), arch


def _ggml_tokenizer(path: Path, header: Any) -> Any:
    """The file's tokenizer for the ggml runner, from the weight cache's entry for the file (an entry
    of no weights: llama.cpp reads those) when there is one, else converted and the entry written."""
    from foveal.engine.models import gguf as direct
    from foveal.engine.models import weight_cache

    key, cached = _from_cache(path, header, {"runner": "ggml"}, lambda entry: direct.tokenizer_from(*entry.tokenizer()))
    if cached is not None:
        return cached
    backend, settings = direct.tokenizer_source(header)
    if key is not None:
        weight_cache.write(key, {}, backend.to_str(), settings)  # before the tokenizer is built on it
    return direct.tokenizer_from(backend, settings)


def _load_direct(path: Path, header: Any, config: Any, options: LoadOptions) -> tuple[Any, Any]:
    """(model, tokenizer) of a llama GGUF file read by gguf.py: built from the weight cache's entry
    for this file and these options when there is one (weight_cache.py), else prepared from the
    file, and the entry written. A damaged entry is reported and replaced, never used."""
    from foveal.engine.models import weight_cache

    variant = {"dtype": str(options.dtype).removeprefix("torch."), "quantize": options.quantize}
    key, cached = _from_cache(path, header, variant, lambda entry: _build_direct(header, config, options, entry)[:2])
    if cached is not None:
        return cached
    keep: dict | None = {} if key is not None else None
    model, tokenizer, source = _build_direct(header, config, options, None, keep)
    if key is not None:
        assert keep is not None  # made with the key
        weight_cache.write(key, keep, *source)
    return model, tokenizer


def _from_cache(path: Path, header: Any, variant: dict, build: Callable[[Any], Any]) -> tuple[dict | None, Any]:
    """(the weight cache's key for this load of `path`, None where the cache is off; `build(entry)` of
    its entry, None where there is none). A damaged entry is reported, never used: the caller then
    prepares from the file and writes the entry again."""
    from foveal.engine.models import weight_cache

    if not weight_cache.enabled():
        return None, None
    key = weight_cache.key(path, header.data_start, variant)
    try:
        entry = weight_cache.open_entry(key)
        return key, (None if entry is None else build(entry))
    except weight_cache.Corrupt as error:
        warnings.warn(
            f"foveal's weight cache entry for {path} is damaged ({error}); preparing it from the file again and "
            "replacing the entry",
            stacklevel=5,
        )
        return key, None


def _build_direct(header: Any, config: Any, options: LoadOptions, entry: Any, keep: dict | None = None):
    """(model, tokenizer, (tokenizer JSON, settings) or None) from the file, or from a cache `entry`;
    `keep`: filled with the prepared weights (gguf.load_quantized) and asks for the tokenizer's JSON."""
    from foveal.engine.models import gguf as direct

    def tokenizer() -> tuple[Any, tuple[str, dict] | None]:
        if entry is not None:
            return direct.tokenizer_from(*entry.tokenizer()), None
        backend, settings = direct.tokenizer_source(header)
        source = (backend.to_str(), settings) if keep is not None else None  # before it is built on
        return direct.tokenizer_from(backend, settings), source

    # The tokenizer's conversion is Python (it holds the GIL); unpacking and packing weights
    # mostly release it, so the two overlap.
    with ThreadPoolExecutor(1) as pool:
        made = pool.submit(tokenizer)
        cached = None if entry is None else entry.parts
        model = direct.load_quantized(header, config, options.dtype, options.quantize, cached, keep)
        return model, *made.result()


def _prepare_decode(runner: HFRunner) -> None:
    """Trace the batch-1 decode graph in the background as soon as the engine allocates the KV
    (traced.py), so that a fresh process's first calls replay it instead of running eager."""
    if runner.decode_graphs is not None:
        runner.decode_graphs = DecodeGraphs(runner._eager, runner.model, kv=lambda: runner.kv, prepare=(1,))


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
    except (
        Exception
    ) as error:  # struct.error, ValueError, IndexError, UnicodeDecodeError: whatever the cut hits
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


def _load_processor(arch: Architecture, path: Path) -> tuple[Any, Any]:
    if not arch.has_vision:
        return None, transformers.AutoTokenizer.from_pretrained(path)
    assert arch.processor_class is not None  # has_vision
    processor = getattr(transformers, arch.processor_class).from_pretrained(path)
    return processor, processor.tokenizer


def _attn_implementation(arch: Architecture) -> str | dict[str, str]:
    name = hf_attention()
    if not arch.has_vision:
        return name
    return {"": name, "text_config": name, "vision_config": "sdpa"}


def assemble(
    model: Any,
    arch: Architecture,
    tokenizer: Any,
    hf_processor: Any,
    source: str,
    options: LoadOptions,
    runner_class: Callable[..., HFRunner] = HFRunner,
    processor: Callable[[HFRunner], Any] | None = None,
) -> LoadedModel:
    """The runner (`runner_class`), the input processor (`processor(runner)`, default InputProcessor)
    and the eos ids of a loaded transformers model."""
    runner = runner_class(model, arch, image_cache_bytes=options.image_cache_bytes)
    if len(tokenizer) > runner.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {runner.vocab_size}: "
            "they do not belong together; save the checkpoint's own tokenizer into the folder"
        )
    if processor is not None:
        input_processor = processor(runner)
    else:
        image_token_id = getattr(model.config, "image_token_id", None) if arch.has_vision else None
        input_processor = InputProcessor(
            arch, tokenizer, hf_processor, runner.device, runner.dtype, image_token_id
        )
    return LoadedModel(runner, tokenizer, input_processor, _eos_ids(model, tokenizer), source)


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
