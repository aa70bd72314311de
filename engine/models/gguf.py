"""A llama-architecture GGUF file loaded quantized, straight from the memory-mapped file.

PROBLEM
    transformers loads a GGUF by dequantizing every tensor to fp32 in numpy and building the model
    from those: a file of 4-bit blocks becomes five times its size in fp32 weights, slowly, which a
    memory-bound CPU decode then reads in full at every step.

SOLUTION
    The file is memory-mapped and its header parsed by transformers' GGUF reader
    (`transformers.integrations.gguf.reader`, which reads the vocabulary in bulk; the `gguf`
    package's `GGUFReader` walks a large vocabulary one numpy view at a time), so each
    tensor's raw blocks are a numpy view of the mapped file. The config is read from the metadata
    (`llama_config`), the tokenizer built by transformers' GGUF tokenizer conversion. The blocks are
    unpacked with a few vectorised numpy ops into foveal's `QuantLinear` (quant.py):
      - Q4_0 / Q4_1 (blocks of 32: an f16 scale d, for Q4_1 an f16 minimum m, 16 bytes of nibbles)
        become int4 with the same groups and codes: scale d, zero 0 (Q4_0: w = d (q - 8)) or m + 8 d,
        stored in bf16 as the kernel requires (so a weight is the file's up to 2^-8 of its block's
        |q - 8| d + |zero|: tests/models/test_gguf_tiny.py).
      - Q8_0 (blocks of 32: an f16 scale, 32 int8) becomes per-row int8 (requantized; see quant.py),
        kept when `quantize` is "int8" or None, and requantized to int4 for "int4" layers;
        a tied vocabulary matrix stays int8 and serves both the embedding lookup and the head.
      - F32 / F16 / BF16 tensors (norms) are read as they are; any other type (K-quants, Q5_*) is
        dequantized by `gguf.quants.dequantize` and quantized like a safetensors weight.
      - Under "fp16" (the default on x86, loader.py) every weight is dequantized to float32 and packed
        as fp16 for fbgemm (`HalfLinear`), the vocabulary matrix too, with fp16 rows for the lookup
        (`HalfEmbedding`): Q4_1's d q + m and Q8_0's d q are f16 products, which fp16 holds to its
        own rounding. Packing runs on torch's intra-op threads (`quant.builder`), and the loader
        converts the tokenizer (Python, under the GIL) at the same time.
    The model is foveal's own module tree in transformers' llama names (`LlamaForCausalLM` below:
    `model.layers[i].self_attn.q_proj`, ...), built from the finished layers, with the config read
    from the metadata (`LlamaTextConfig`, LlamaConfig's fields): lean.py's decoder runs every launch
    of a text model, so transformers' llama modules, whose import pulls transformers' modeling,
    distributed and compiler code (seconds of a fresh process), are not needed. llama.cpp
    stores Q and K rows permuted for its interleaved rotary; the rows are permuted back (rows are
    whole quantization blocks, so this is exact on the packed data), as transformers does.
    Each weight is first made into named tensors (`prepare`), then a layer (`layer_from`): the
    weight cache (weight_cache.py) stores the former, so a later load skips the unpacking and
    dequantizing and builds the same layers from the same tensors.

INVARIANTS
    - Every parameter and buffer of the model comes from the file (or the parts an earlier load
      prepared of it, weight_cache.py) or from the config (rotary frequencies, computed as
      transformers' llama computes them: tests/models/test_gguf_tiny.py).
    - Under "int4" the Q4_0/Q4_1 weights the kernel multiplies by are the file's codes and groups,
      with scales and zeros rounded to bf16;
      against the fp32 weights transformers dequantizes, SmolLM2's greedy answers agree as measured
      in tests/models/test_gguf.py (bf16 activations and the int8 vocabulary matrix are the
      difference: 70 of 101 tokens before a fork); under "fp16", 101 of 101.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.configuration_utils import PreTrainedConfig

from foveal.engine.models.arch import ModelLoadError
from foveal.engine.models.quant import (
    GROUP_SIZE,
    HalfEmbedding,
    HalfLinear,
    QuantEmbedding,
    QuantLinear,
    SplitLinear,
    builder,
)

# GGUF tensor name (per block) -> (module path in LlamaDecoderLayer, rows permuted for rotary as "q"/"k")
LAYER_LINEARS = {
    "attn_q": ("self_attn.q_proj", "q"),
    "attn_k": ("self_attn.k_proj", "k"),
    "attn_v": ("self_attn.v_proj", None),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_proj", None),
    "ffn_up": ("mlp.up_proj", None),
    "ffn_down": ("mlp.down_proj", None),
}
LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
DIRECT_ARCHITECTURES = ("llama",)
SPLIT = "split"  # prepare's mode for the default on x86: Q4 blocks as SplitLinear
REQUIRED_METADATA = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


def read_header(path: Path) -> Any:
    """The file's metadata and tensor table (transformers' `GgufHeader`); raises on a malformed file."""
    from transformers.integrations.gguf.reader import GgufHeader

    return GgufHeader.from_file(str(path))


def tensor_data(header: Any, info: Any) -> np.ndarray:
    """A tensor's raw bytes: a view of the mapped file, nothing read until used."""
    blob = np.memmap(header.path, mode="r", dtype=np.uint8)
    start = header.data_start + info.offset
    return blob[start : start + info.nbytes]


def is_direct(header: Any) -> bool:
    """Whether this module loads the file (a llama-architecture model with plain rotary)."""
    names = {t.name for t in header.tensors}
    return header.architecture in DIRECT_ARCHITECTURES and "rope_freqs.weight" not in names


def llama_config(path: Path, header: Any) -> LlamaTextConfig:
    """The model's config from the file's `llama.*` metadata (the fields transformers' GGUF path
    derives into a LlamaConfig)."""
    meta, names = read_metadata(header), {t.name for t in header.tensors}
    if any(key.startswith("llama.rope.scaling") for key in meta):
        raise ModelLoadError("rope scaling in a GGUF file is not supported by foveal's direct GGUF loader")
    arch = "llama"
    missing = [key for key in REQUIRED_METADATA if f"{arch}.{key}" not in meta]
    if missing:
        raise ModelLoadError(
            f"{path} has no {', '.join(f'{arch}.{key}' for key in missing)} in its metadata; it is not a complete "
            "llama model file"
        )
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.rope.dimension_count", hidden // heads)
    # the config's fields: extra keywords, taken at runtime (transformers' config dataclasses accept them),
    # not in the dataclass signature mypy reads
    config = LlamaTextConfig(  # type: ignore[call-arg]
        vocab_size=meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"],
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0)},
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in names,
        hidden_act="silu",
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def tokenizer(header: Any) -> Any:
    """The file's tokenizer, through transformers' GGUF conversion (what `AutoTokenizer(gguf_file=)` builds)."""
    return tokenizer_from(*tokenizer_source(header))


def tokenizer_source(header: Any) -> tuple[Any, dict[str, Any]]:
    """(the `tokenizers.Tokenizer` transformers' GGUF conversion builds of the file, the settings
    `tokenizer_from` builds the tokenizer with): what the weight cache stores of a tokenizer.

    The metadata is read by `read_metadata` (several times faster than transformers'
    `get_gguf_tokenizer`, which was a quarter of a GGUF load's critical path: docs/performance.md)
    and grouped by transformers' own key table, as `get_gguf_tokenizer` does for a llama file:
    sentencepiece ("llama") vocabularies add BOS unless the file says otherwise.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    metadata = read_metadata(header, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    vocabulary, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if vocabulary.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = vocabulary["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], vocabulary)
    return backend, {**config, **extra}


def tokenizer_from(backend: Any, settings: dict[str, Any]) -> Any:
    """A transformers tokenizer of a `tokenizers.Tokenizer` (or of a file of its JSON) and
    `tokenizer_source`'s settings."""
    import transformers

    if isinstance(backend, Path):
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(backend), **settings)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **settings)


# GGUF's special-token id keys (tokenizer.ggml.*), by the tokenizer attribute they name
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# GGUF metadata value types (the GGUF spec): fixed-size ones by struct format; 8 string, 9 array
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_metadata(header: Any, string_arrays: tuple[str, ...] = ()) -> dict[str, Any]:
    """The file's metadata: numbers, strings and numeric arrays (lists) as they are; string arrays
    in full when named in `string_arrays`, else their length (what transformers' reader gives).

    Strings are cut from one `bytes` of the header: transformers' reader slices a numpy memmap
    per string, which for a vocabulary's and merges' tens of thousands of strings is a large share
    of a load (docs/performance.md).
    """
    with open(header.path, "rb") as f:
        blob = f.read(header.data_start)  # the parsed header (`read_header`) says where the metadata ends
    _, _, count = struct.unpack_from("<IQQ", blob, 4)
    metadata, pos = {}, 24
    for _ in range(count):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind, key in string_arrays)
    return metadata


def _string(blob: bytes, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return blob[pos + 8 : pos + 8 + length].decode("utf-8"), pos + 8 + length


def _value(blob: bytes, pos: int, kind: int, keep_strings: bool) -> tuple[Any, int]:
    if kind in _FIXED:
        return struct.unpack_from(_FIXED[kind], blob, pos)[0], pos + struct.calcsize(_FIXED[kind])
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ModelLoadError(f"GGUF metadata value of unknown type {kind}")
    item, n = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _FIXED:
        width = struct.calcsize(_FIXED[item])
        return list(struct.unpack_from(f"<{n}{_FIXED[item][1]}", blob, pos)), pos + n * width
    if item != _STRING:
        raise ModelLoadError(f"GGUF metadata array of unsupported type {item}")
    strings = []
    for _ in range(n):
        (length,) = struct.unpack_from("<Q", blob, pos)
        if keep_strings:
            strings.append(blob[pos + 8 : pos + 8 + length].decode("utf-8"))
        pos += 8 + length
    return (strings if keep_strings else n), pos


def load_quantized(
    header: Any,
    config: Any,
    dtype: torch.dtype,
    quantize: str | None,
    cached: Callable[[str], dict[str, torch.Tensor]] | None = None,
    keep: dict[str, dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """A LlamaForCausalLM whose decoder linears (and head) are read from the file's tensors.

    `quantize`: None with a float32 `dtype` (the default where fbgemm runs) makes the file's Q4
    blocks `SplitLinear`s (int4 for few-row launches, fp16 for many) and everything else what
    "fp16" makes it; None with bf16 keeps Q4 blocks as int4 and makes other types int8; "int8" or
    "int4" asks for that kernel for every decoder layer; "fp16" makes every linear, the head
    included, a `HalfLinear` and the embeddings fp16 rows (`dtype` must then be float32). See
    `prepare`. Layers are built on torch's intra-op threads (`quant.builder`).

    `cached(name)`: the parts `prepare` made of the tensor `name` in an earlier load (the weight
    cache, weight_cache.py), used instead of the file's blocks; `keep`: filled with the parts
    built here, by tensor name, fp16 weights rounded to fp16 (what the cache stores).
    """
    tensors = {t.name: t for t in header.tensors}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    read = lambda name: (_need(tensors, name), tensor_data(header, _need(tensors, name)))  # noqa: E731
    tied = "output.weight" not in tensors
    fp16 = quantize == "fp16" or (quantize is None and dtype == torch.float32)  # float32 activations
    layer_mode = SPLIT if quantize is None and fp16 else quantize

    def parts(name: str, mode: str | None, permute: int | None, head: bool = False) -> dict[str, torch.Tensor]:
        made = cached(name) if cached is not None else prepare(*read(name), dtype, mode, permute, head)
        if keep is not None:
            keep[name] = {part: t.half() if part == FP16_WEIGHT else t for part, t in made.items()}
        return made

    def linear(name: str, mode: str | None, permute: int | None, head: bool = False) -> nn.Module:
        return layer_from(parts(name, mode, permute, head))

    with builder() as pool:
        # The vocabulary matrix first, and under fp16 its head's pack right after: that pack is the
        # longest single job (a fifth of SmolLM2's weights, packed at 2-3x the time a weight of the
        # others takes), which run last would leave the other threads idle while it finishes.
        vocab = pool.submit(parts, "token_embd.weight", "fp16" if fp16 else "int8", None, True)
        head: Future[nn.Module]
        if fp16 and tied:
            head = pool.submit(lambda: HalfLinear(vocab.result()[FP16_WEIGHT].float()))
        elif fp16:
            head = pool.submit(linear, "output.weight", "fp16", None)
        elif not tied:
            head = pool.submit(linear, "output.weight", "int8", None, True)
        rotary_rows: dict[str | None, int] = {"q": heads, "k": kv_heads}
        jobs = {
            (index, path): pool.submit(
                linear, f"blk.{index}.{name}.weight", layer_mode, rotary_rows.get(rotary)
            )
            for index in range(config.num_hidden_layers)
            for name, (path, rotary) in LAYER_LINEARS.items()
        }
        embed: nn.Module
        if fp16:
            embed = HalfEmbedding(vocab.result()[FP16_WEIGHT], config.pad_token_id)
        else:
            # One int8 matrix serves the lookup and, tied, the head.
            matrix = layer_from(vocab.result())
            assert isinstance(matrix, QuantLinear)  # int8 parts
            embed = QuantEmbedding(matrix, config.pad_token_id)
            if tied:
                head = pool.submit(lambda: matrix)
        norms = [
            [_float(*read(f"blk.{index}.{name}.weight"), dtype) for name in LAYER_NORMS]
            for index in range(config.num_hidden_layers)
        ]
        final_norm = _float(*read("output_norm.weight"), dtype)
        layers = [
            LlamaDecoderLayer(config, {path: jobs[index, path].result() for path, _ in LAYER_LINEARS.values()}, *norm)
            for index, norm in enumerate(norms)
        ]
        model = LlamaForCausalLM(config, embed, layers, final_norm, head.result())
    return model.eval()


# The parts of one prepared weight (`prepare`), by name: what `layer_from` builds a layer of.
INT4_PACKED, INT4_SCALES = "int4.packed", "int4.scales"  # an int4 QuantLinear's buffers
INT8_PACKED, INT8_SCALES = "int8.packed", "int8.scales"  # an int8 QuantLinear's buffers
FP16_WEIGHT = "fp16.weight"  # the weight [N, K] a HalfLinear packs (float32, or fp16: the same pack)


def prepare(
    info: Any,
    data: np.ndarray,
    dtype: torch.dtype,
    mode: str | None,
    permute_heads: int | None,
    head: bool = False,
) -> dict[str, torch.Tensor]:
    """One GGUF weight [N, K] as the parts of a QuantLinear, or of a HalfLinear when `mode` is "fp16",
    or for `SPLIT` of a SplitLinear of the file's Q4 blocks (its int4 half exactly `mode="int4"`'s
    layer) and of a HalfLinear for any other type.

    Decoder layers (`head=False`): Q4_0/Q4_1 blocks are kept as int4 (codes and groups) unless `mode` is "int8"
    (then requantized per row: on CPUs where the int8 kernel is the faster one at batch 1, quant.py)
    or "fp16"; Q8_0 becomes per-row int8 (None, "int8") or int4
    ("int4"); anything else is dequantized, then quantized to `mode` (None: int8). The vocabulary
    matrix (`head=True`) is per-row int8 whatever its type, except under "fp16".
    """
    from gguf import GGMLQuantizationType as Q

    kind = Q(info.ggml_type)
    n, k = info.shape  # torch order: [out, in]
    if mode == SPLIT and not head and kind in (Q.Q4_0, Q.Q4_1):
        codes, scale, zero = _q4_blocks(_rows(data, n, permute_heads), kind == Q.Q4_1, k)
        int4 = QuantLinear.int4_from_codes(codes, scale, zero, None, torch.bfloat16, GROUP_SIZE)
        return {**_int_parts(int4), FP16_WEIGHT: _q4_weight(codes, scale, zero)}
    if mode == SPLIT:
        mode = "fp16"
    if kind in (Q.Q4_0, Q.Q4_1) and not head and mode in (None, "int4"):
        raw = _rows(data, n, permute_heads)
        codes, scale, zero = _q4_blocks(raw, kind == Q.Q4_1, k)
        return _int_parts(QuantLinear.int4_from_codes(codes, scale, zero, None, dtype, GROUP_SIZE))
    weight = gguf_weight(info, data, permute_heads)
    if mode == "fp16":
        return {FP16_WEIGHT: weight}
    if head or mode != "int4":
        return _int_parts(QuantLinear.int8_from_float(weight, None, dtype))
    return _int_parts(QuantLinear.int4_from_float(weight, None, dtype))


def layer_from(parts: dict[str, torch.Tensor]) -> QuantLinear | HalfLinear | SplitLinear:
    """The layer of `prepare`'s parts: a SplitLinear of int4 + fp16 parts, else the one layer they make."""
    half = HalfLinear(parts[FP16_WEIGHT].float()) if FP16_WEIGHT in parts else None
    if INT8_PACKED in parts:
        packed, scales = parts[INT8_PACKED], parts[INT8_SCALES]
        return QuantLinear("int8", packed, scales, packed.shape[1], packed.shape[0])
    if INT4_PACKED not in parts:
        assert half is not None  # parts hold int8, int4 or fp16 weights
        return half
    packed, scales = parts[INT4_PACKED], parts[INT4_SCALES]  # [N, K / 2], [K / group, N, 2]
    n, k = packed.shape[0], 2 * packed.shape[1]
    int4 = QuantLinear("int4", packed, scales, k, n, None, k // scales.shape[0])
    return int4 if half is None else SplitLinear(int4, half)


def _int_parts(layer: QuantLinear) -> dict[str, torch.Tensor]:
    return {f"{layer.mode}.packed": layer.packed, f"{layer.mode}.scales": layer.scales}


# ---- the model the file's tensors fill --------------------------------------------------------------------------


class LlamaTextConfig(PreTrainedConfig):
    """A llama text model's config: LlamaConfig's fields, without importing transformers' llama (its
    config module imports transformers' modeling and distributed code, seconds of a fresh process)."""

    model_type = "llama"


class RMSNorm(nn.Module):
    """The weight of an RMS norm (lean.py applies it with `F.rms_norm`)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)


class LlamaRotaryEmbedding(nn.Module):
    """Default rotary (no scaling): cos and sin of position x inverse frequency, as transformers' llama
    computes them, to the bit (tests/models/test_gguf_tiny.py compares the two)."""

    inv_freq: torch.Tensor  # a buffer (register_buffer in __init__), typed for the checker

    def __init__(self, config: LlamaTextConfig) -> None:
        super().__init__()
        base, dim = config.rope_parameters["rope_theta"], config.head_dim
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer's modules, in transformers' names (`self_attn.q_proj`, `mlp.up_proj`, ...), and
    named as transformers' class: lean.py's `LeanDecoder` runs layers of this shape by that name."""

    def __init__(self, config: LlamaTextConfig, linears: dict[str, nn.Module], input_norm, post_norm) -> None:
        super().__init__()
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        for path, module in linears.items():
            parent, _, name = path.partition(".")
            setattr(getattr(self, parent), name, module)
        self.self_attn.scaling = config.head_dim**-0.5
        self.mlp.act_fn = nn.SiLU()
        self.input_layernorm = RMSNorm(input_norm, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(post_norm, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A llama text model's modules in transformers' tree (`model.layers`, `model.norm`, `lm_head`):
    what `HFRunner` drives, always through lean.py's forward (a GGUF model has no image inputs)."""

    def __init__(self, config, embed: nn.Module, layers: Sequence[nn.Module], norm: torch.Tensor, head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = embed
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(norm, config.rms_norm_eps)
        self.model.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = head

    def get_decoder(self) -> nn.Module:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return cast(nn.Module, self.model.embed_tokens)  # set in __init__

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "a GGUF model runs through foveal's lean decoder (HFRunner with lean=True), not a transformers forward"
        )


def gguf_weight(info: Any, data: np.ndarray, permute_heads: int | None = None) -> torch.Tensor:
    """One GGUF weight [N, K] dequantized to float32 (Q4_0/Q4_1/Q8_0 by vectorised numpy here,
    other types by `gguf.quants`), its rows in transformers' order."""
    from gguf import GGMLQuantizationType as Q

    kind = Q(info.ggml_type)
    n, k = info.shape
    raw = _rows(data, n, permute_heads)
    if kind in (Q.Q4_0, Q.Q4_1):
        return _q4_weight(*_q4_blocks(raw, kind == Q.Q4_1, k))
    if kind == Q.Q8_0:
        blocks = raw.reshape(n, k // 32, 34)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [N, K/32, 1]
        return torch.from_numpy(blocks[..., 2:].view(np.int8).astype(np.float32) * d).reshape(n, k)
    return _dequantize(kind, raw, n, k)


def _rows(data: np.ndarray, n: int, permute_heads: int | None) -> np.ndarray:
    raw = data.reshape(n, -1)
    return raw if permute_heads is None else _unpermute_rows(raw, permute_heads)


def _q4_blocks(raw: np.ndarray, has_min: bool, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 rows -> int4 codes [N, K] (0..15), scale and zero [N, K/32] for w = (q - 8) scale + zero."""
    n = raw.shape[0]
    width = 20 if has_min else 18
    blocks = raw.reshape(n, k // 32, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., width - 16 :]
    # Element j of a block is the low nibble of byte j, element j + 16 its high nibble.
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    if has_min:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)


def _q4_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `_q4_blocks`' codes, scales and zeros."""
    n, k = codes.shape
    return ((codes.float() - 8).view(n, -1, 32) * scale[..., None] + zero[..., None]).view(n, k)


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (per head: pairs interleaved) on whole rows of raw blocks."""
    n = rows.shape[0]
    dim = n // heads // 2
    return np.ascontiguousarray(rows.reshape(heads, dim, 2, -1).swapaxes(1, 2).reshape(rows.shape))


def _dequantize(kind: Any, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if kind in (Q.F32, Q.F16):
        values = raw.view(np.float32 if kind == Q.F32 else np.float16)
    else:
        values = quants.dequantize(raw, kind)
    return torch.from_numpy(np.ascontiguousarray(values).astype(np.float32)).reshape(n, k)


def _float(info: Any, data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A small float tensor (a norm's weight), whatever its stored type."""
    from gguf import GGMLQuantizationType as Q

    n = int(np.prod(info.shape))
    return _dequantize(Q(info.ggml_type), data.reshape(1, -1), 1, n).reshape(-1).to(dtype)


def _need(tensors: dict[str, Any], name: str) -> Any:
    if name not in tensors:
        raise ModelLoadError(f"the GGUF file has no tensor {name!r}; it is not a complete llama model")
    return tensors[name]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
