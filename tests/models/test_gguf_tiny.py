"""foveal's direct GGUF loader (engine/models/gguf.py) on a tiny llama file written here, offline.

tests/models/test_gguf.py checks the loader on a real 93 MB file, marked slow. These tests write a
complete llama GGUF of ~80 KB into tmp_path with the `gguf` package's writer (2 layers, hidden 64,
4 heads over 2 KV heads, a byte-level BPE tokenizer of 265 tokens) and load it through
`foveal.engine.models.load(path, device="cpu", runner="torch", quantize=...)`. They check:
  - "fp16": HalfLinear / HalfEmbedding layers, float32 activations, weights equal to the file's
    rounded to fp16, and greedy tokens and logits matching transformers' LlamaForCausalLM that
    holds the file's dequantized weights in float32;
  - "int4": the file's Q4_0 / Q4_1 blocks become int4 QuantLinears holding the file's weights, up
    to the bf16 rounding of each block's scale and zero; "int8": every layer per-row int8;
  - quantize=None: where fbgemm is available, Q4 blocks as SplitLinear (int4 for few rows, fp16
    for many) and "fp16" for the rest; else the file's own blocks (int4, int8);
  - a tied file (no `output.weight`) and an untied one: the head is the right matrix;
  - the tokenizer transformers builds from the file's `tokenizer.ggml.*` metadata.

The reference weights are the block data dequantized by `gguf.quants.dequantize`, in transformers'
row order. The file holds the same blocks with the Q and K rows in llama.cpp's rotary order, as
llama.cpp's converter writes them, so a loader that did not permute them back fails here (logits
off by 15-40 when measured), as does one that ignored the rope base (18).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from foveal.engine.models.arch import ModelLoadError
from foveal.engine.models.processor import PromptInputs
from foveal.engine.models.quant import (
    FEW_ROWS,
    HalfEmbedding,
    HalfLinear,
    QuantEmbedding,
    QuantLinear,
    SplitLinear,
    fp16_kernel_available,
)
from foveal.families import load
from foveal.testing import parity

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 128, 4, 2  # in_features are multiples of the 32-block
HEAD_DIM = HIDDEN // HEADS
ROPE_THETA, RMS_EPS = 5000.0, 1e-6  # not llama's defaults (10000, 1e-5)

# GGUF name -> (module in a transformers decoder layer, out_features, in_features, the file's type).
# The types mix both Q4 kinds, Q8_0 and BF16 (read through gguf.quants.dequantize), as real files do
# (SmolLM2's is Q4_1 with Q8_0 parts). Q5_0/Q5_1 would take the BF16 path in the loader too, but
# transformers' header reader refuses those types (ggml 6, 7).
LINEARS = {
    "attn_q": ("self_attn.q_proj", HEADS * HEAD_DIM, HIDDEN, Q.Q4_1),
    "attn_k": ("self_attn.k_proj", KV_HEADS * HEAD_DIM, HIDDEN, Q.Q4_0),
    "attn_v": ("self_attn.v_proj", KV_HEADS * HEAD_DIM, HIDDEN, Q.Q8_0),
    "attn_output": ("self_attn.o_proj", HIDDEN, HEADS * HEAD_DIM, Q.BF16),
    "ffn_gate": ("mlp.gate_proj", FFN, HIDDEN, Q.Q4_1),
    "ffn_up": ("mlp.up_proj", FFN, HIDDEN, Q.Q4_0),
    "ffn_down": ("mlp.down_proj", HIDDEN, FFN, Q.Q4_1),
}
Q4_LINEARS = [name for name, (*_, kind) in LINEARS.items() if kind in (Q.Q4_0, Q.Q4_1)]
OTHER_LINEARS = [name for name in LINEARS if name not in Q4_LINEARS]
VOCAB_TYPE = Q.Q8_0  # token_embd.weight and output.weight, as in SmolLM2's file

# A byte-level BPE vocabulary: the 256 byte symbols (GPT-2's alphabet; 'Ġ' is a space), the tokens
# of a few merges, and one control token serving as BOS and EOS.
MERGES = ["Ġ t", "h e", "Ġt he", "t he", "a n", "an d", "a t", "Ġ c"]
EOS_TOKEN = "<|endoftext|>"


def _vocabulary() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + [EOS_TOKEN]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    return tokens, [int(t) for t in types]


TOKENS, TOKEN_TYPES = _vocabulary()
VOCAB, EOS_ID = len(TOKENS), len(TOKENS) - 1

# Weight scales and seeds: the random model's greedy picks must not be near-ties that fp16's
# rounding could flip. Measured with these: logits up to 17-20, the closest top-2 gap over all
# steps 0.21 (untied) and 0.28 (tied) against a largest fp16-vs-fp32 logit difference of 0.012.
VOCAB_STD = 0.5  # the vocabulary matrices; the linears' weights have std 1 / sqrt(in_features)
SEEDS = {"tied": 0, "untied": 0}
PROMPTS = [[EOS_ID, 5, 72, 101, 108], [33, 200, 17], [EOS_ID, 257, 259, 260, 261, 262, 263, 264, 90]]
NEW_TOKENS = 6


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py, `LlamaModel.permute`): per head, the two
    rotary halves interleaved. Blocks run along rows, so it applies to block data as to floats."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


@dataclass
class TinyGguf:
    path: Path
    tied: bool
    blocks: dict[str, np.ndarray]  # GGUF name -> its block bytes, in transformers' row order
    weights: dict[str, torch.Tensor]  # GGUF name -> those blocks dequantized (float32)

    def head_name(self) -> str:
        return "token_embd.weight" if self.tied else "output.weight"

    def reference(self) -> transformers.LlamaForCausalLM:
        """transformers' llama in float32, holding exactly the file's dequantized weights."""
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            max_position_embeddings=128, rms_norm_eps=RMS_EPS,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            bos_token_id=EOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=self.tied,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config).eval()
        state = {
            "model.embed_tokens.weight": self.weights["token_embd.weight"],
            "model.norm.weight": self.weights["output_norm.weight"],
            "lm_head.weight": self.weights[self.head_name()],
        }
        for i in range(LAYERS):
            for name, (module, *_) in LINEARS.items():
                state[f"model.layers.{i}.{module}.weight"] = self.weights[f"blk.{i}.{name}.weight"]
            state[f"model.layers.{i}.input_layernorm.weight"] = self.weights[f"blk.{i}.attn_norm.weight"]
            state[f"model.layers.{i}.post_attention_layernorm.weight"] = self.weights[
                f"blk.{i}.ffn_norm.weight"
            ]
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not missing and not unexpected
        return model


def write_tiny_gguf(path: Path, tied: bool, seed: int) -> TinyGguf:
    """A complete llama GGUF with random weights; returns what it holds, in transformers' order."""
    rng = np.random.default_rng(seed)
    blocks, weights = {}, {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    if not tied:
        writer.add_vocab_size(VOCAB)  # optional: for the tied file the loader counts the tokens
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOS_ID)
    writer.add_eos_token_id(EOS_ID)

    def blocked(name: str, weight: np.ndarray, kind: Q, permute_heads: int | None = None) -> None:
        data = gguf.quants.quantize(weight.astype(np.float32), kind)
        blocks[name] = data
        weights[name] = torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))
        if permute_heads is not None:
            data = np.ascontiguousarray(llama_cpp_permute(data, permute_heads))
        writer.add_tensor(name, data, raw_dtype=kind)

    def plain(name: str, weight: np.ndarray) -> None:  # norms: F32, as llama.cpp writes them
        weights[name] = torch.from_numpy(weight.astype(np.float32))
        writer.add_tensor(name, weight.astype(np.float32))

    blocked("token_embd.weight", rng.normal(0, VOCAB_STD, (VOCAB, HIDDEN)), VOCAB_TYPE)
    plain("output_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
    if not tied:
        blocked("output.weight", rng.normal(0, VOCAB_STD, (VOCAB, HIDDEN)), VOCAB_TYPE)
    for i in range(LAYERS):
        for name, (_, n, k, kind) in LINEARS.items():
            permute = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            blocked(f"blk.{i}.{name}.weight", rng.normal(0, 1 / np.sqrt(k), (n, k)), kind, permute)
        plain(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
        plain(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGguf(path, tied, blocks, weights)


@pytest.fixture(autouse=True)
def _own_weight_cache(tmp_path, monkeypatch):
    """Each test's loads prepare the weights from the file and write their weight cache entries
    (weight_cache.py) into the test's own folder, not the user's cache."""
    monkeypatch.setenv("FOVEAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FOVEAL_WEIGHT_CACHE", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, TinyGguf]:
    root = tmp_path_factory.mktemp("gguf")
    return {
        kind: write_tiny_gguf(root / f"{kind}.gguf", kind == "tied", seed) for kind, seed in SEEDS.items()
    }


def _linear(loaded, i: int, name: str):
    return loaded.runner.model.get_decoder().layers[i].get_submodule(LINEARS[name][0])


def _all_linears(loaded, names=LINEARS):
    return [(f"blk.{i}.{name}.weight", _linear(loaded, i, name)) for i in range(LAYERS) for name in names]


def _greedy_against_transformers(loaded, reference) -> tuple[bool, float, float]:
    """(greedy tokens equal, largest |logit difference|, largest |logit|) of foveal's runner (all
    prompts batched, paged KV) against transformers' generate on each prompt alone."""
    prompts = [PromptInputs(list(ids), None) for ids in PROMPTS]
    ours = parity.greedy(loaded.runner, prompts, NEW_TOKENS, loaded.eos_token_ids)
    equal, worst, largest = True, 0.0, 0.0
    for seq, prompt in enumerate(prompts):
        tokens, logits = parity.reference_greedy(reference, prompt, loaded.runner.arch, NEW_TOKENS)
        equal &= tokens == ours.tokens[seq]
        for a, b in zip(ours.logits[seq], logits, strict=False):
            worst = max(worst, float((a - b).abs().max()))
            largest = max(largest, float(b.abs().max()))
    return equal, worst, largest


# -- quantize="fp16" (the default on x86) ---------------------------------------------------------

needs_fbgemm = pytest.mark.skipif(
    not fp16_kernel_available(), reason="quantize='fp16' needs torch's fbgemm (x86)"
)


@needs_fbgemm
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_fp16_greedy_tokens_and_logits_match_transformers_on_the_files_weights(files, kind):
    tiny = files[kind]
    loaded = load(tiny.path, device="cpu", runner="torch", quantize="fp16")
    runner = loaded.runner
    assert runner.dtype == torch.float32 and runner.vocab_size == VOCAB
    assert loaded.name == "llama" and EOS_ID in loaded.eos_token_ids
    assert all(isinstance(layer, HalfLinear) for _, layer in _all_linears(loaded))
    assert isinstance(runner.model.lm_head, HalfLinear)
    assert isinstance(runner.model.get_decoder().embed_tokens, HalfEmbedding)

    equal, worst, largest = _greedy_against_transformers(loaded, tiny.reference())
    assert equal
    # The only difference is fp16's rounding of each weight (relative 2^-11 = 4.9e-4), compounded
    # through two layers: measured 7e-4 of the largest logit (0.012 of 17-20); a wrong row order
    # or rope base is 15-40 off.
    assert worst < 2e-3 * largest


@needs_fbgemm
def test_fp16_weights_are_the_files_rounded_to_half_with_q_and_k_rows_unpermuted(files):
    tiny = files["untied"]
    loaded = load(tiny.path, device="cpu", runner="torch", quantize="fp16")
    for key, layer in _all_linears(loaded):
        assert torch.equal(layer.dequantize(), tiny.weights[key].half().float()), key
    for i, layer in enumerate(loaded.runner.model.get_decoder().layers):
        assert torch.equal(layer.input_layernorm.weight, tiny.weights[f"blk.{i}.attn_norm.weight"])
        assert torch.equal(layer.post_attention_layernorm.weight, tiny.weights[f"blk.{i}.ffn_norm.weight"])


@needs_fbgemm
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_fp16_head_is_the_output_matrix_or_else_the_tied_embedding(files, kind):
    tiny = files[kind]
    model = load(tiny.path, device="cpu", runner="torch", quantize="fp16").runner.model
    assert model.config.tie_word_embeddings is tiny.tied
    embedding = tiny.weights["token_embd.weight"].half().float()
    assert torch.equal(model.get_decoder().embed_tokens.weight.float(), embedding)
    assert torch.equal(model.lm_head.dequantize(), tiny.weights[tiny.head_name()].half().float())
    if not tiny.tied:  # the matrices differ, so the head cannot pass by being the embedding
        assert not torch.equal(model.lm_head.dequantize(), embedding)


@needs_fbgemm
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_default_splits_q4_blocks_into_int4_for_few_rows_and_fp16_for_many(files, kind):
    """quantize=None on x86: float32 activations; the file's Q4 blocks are SplitLinears whose int4
    half holds the file's codes and groups (bf16 scales, as under "int4") and whose fp16 half holds
    the file's weights rounded to fp16; every other weight is what "fp16" makes it."""
    tiny = files[kind]
    loaded = load(tiny.path, device="cpu", runner="torch")
    model = loaded.runner.model
    assert loaded.runner.dtype == torch.float32
    for key, layer in _all_linears(loaded, Q4_LINEARS):
        assert isinstance(layer, SplitLinear), key
        assert torch.equal(layer.dequantize(FEW_ROWS + 1), tiny.weights[key].half().float()), key
        error = (layer.dequantize(1) - tiny.weights[key]).abs()
        assert (error <= _int4_bound(tiny.blocks[key], LINEARS[key.split(".")[2]][3])).all(), key
    assert all(isinstance(layer, HalfLinear) for _, layer in _all_linears(loaded, OTHER_LINEARS))
    assert isinstance(model.lm_head, HalfLinear)
    assert isinstance(model.get_decoder().embed_tokens, HalfEmbedding)


@needs_fbgemm
def test_default_decodes_close_to_transformers_on_the_files_weights(files):
    """The few-row path rounds activations to bf16 at each Q4 layer's input and output (2^-8
    relative) and its scales to bf16: logits within 2% of the largest logit through two layers
    (measured 0.4% tied, 0.8% untied, greedy tokens equal); fp16's own rounding alone is 4-7e-4 of
    it (the "fp16" test above), and "int4", bf16 everywhere, 0.7-1.15 of it (tokens fork)."""
    loaded = load(files["untied"].path, device="cpu", runner="torch")
    _, worst, largest = _greedy_against_transformers(loaded, files["untied"].reference())
    assert worst < 2e-2 * largest


def test_a_bf16_dtype_with_the_default_kernels_is_refused_before_loading(files):
    if not fp16_kernel_available():
        pytest.skip("the float32 default runs where fbgemm does")
    with pytest.raises(ModelLoadError, match="float32 activations"):
        load(files["tied"].path, device="cpu", runner="torch", dtype="bfloat16")


# -- the int kernels: quantize="int4", "int8", and the default without fbgemm ---------------------


def _int4_bound(block: np.ndarray, kind: Q) -> torch.Tensor:
    """Per weight, how far an int4 layer built from these Q4 blocks may be from the file's value.

    The layer stores each block's scale d and zero z (Q4_0: 0, Q4_1: m + 8 d) in bf16 (8 significant
    bits: relative rounding error <= 2^-8) and computes w = (q - 8) d + z in float32, so
    |error| <= 2^-8 (|q - 8| |d| + |z|) (measured: up to 0.98 of it). Requantizing the dequantized
    weights instead would be off by up to d / 2, 4x more than this bound at its largest."""
    rows = block.shape[0]
    width = 20 if kind == Q.Q4_1 else 18  # f16 d, (Q4_1: f16 m), 16 bytes of nibbles
    b = block.reshape(rows, -1, width)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    z = b[..., 2:4].copy().view(np.float16).astype(np.float32) + 8 * d if kind == Q.Q4_1 else 0 * d
    nibbles = b[..., width - 16 :]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
    bound = 2.0**-8 * (np.abs(q - 8) * np.abs(d) + np.abs(z))
    return torch.from_numpy(bound.reshape(rows, -1)) + 1e-7


def _assert_q4_kept_as_int4(loaded, tiny: TinyGguf) -> None:
    for key, layer in _all_linears(loaded, Q4_LINEARS):
        assert isinstance(layer, QuantLinear) and layer.mode == "int4", key
        error = (layer.dequantize() - tiny.weights[key]).abs()
        kind = LINEARS[key.split(".")[2]][3]
        assert (error <= _int4_bound(tiny.blocks[key], kind)).all(), (key, float(error.max()))


def _assert_int8_rows(layer, weight: torch.Tensor, key: str) -> None:
    """A per-row int8 layer of `weight`: within half a step of the row's scale, plus the scale's
    bf16 rounding (2^-8 relative) times up to 127 steps."""
    assert isinstance(layer, QuantLinear) and layer.mode == "int8", key
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantize() - weight).abs() <= step * (0.5 + 127 * 2.0**-8) + 1e-7).all(), key


def test_int4_keeps_the_files_q4_blocks_up_to_bf16_scales(files):
    tiny = files["untied"]
    loaded = load(tiny.path, device="cpu", runner="torch", quantize="int4")
    assert loaded.runner.dtype == torch.bfloat16
    _assert_q4_kept_as_int4(loaded, tiny)
    assert all(layer.mode == "int4" for _, layer in _all_linears(loaded, OTHER_LINEARS))  # requantized
    _assert_int8_rows(loaded.runner.model.lm_head, tiny.weights["output.weight"], "output.weight")


def test_int8_makes_every_layer_per_row_int8(files):
    """gguf.py's rule: "int8" requantizes Q4 blocks too (its kernel was the faster one at batch 1)."""
    tiny = files["untied"]
    loaded = load(tiny.path, device="cpu", runner="torch", quantize="int8")
    assert loaded.runner.dtype == torch.bfloat16
    for key, layer in _all_linears(loaded):
        _assert_int8_rows(layer, tiny.weights[key], key)


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_default_without_fbgemm_keeps_the_files_blocks(files, kind, monkeypatch):
    """Where fp16 has no kernel (ARM), quantize=None keeps Q4 as int4 and makes the rest int8."""
    monkeypatch.setattr("foveal.engine.models.loader.fp16_kernel_available", lambda: False)
    tiny = files[kind]
    loaded = load(tiny.path, device="cpu", runner="torch")
    model = loaded.runner.model
    assert loaded.runner.dtype == torch.bfloat16
    _assert_q4_kept_as_int4(loaded, tiny)
    for key, layer in _all_linears(loaded, OTHER_LINEARS):  # Q8_0, BF16
        _assert_int8_rows(layer, tiny.weights[key], key)
    head, embed = model.lm_head, model.get_decoder().embed_tokens
    _assert_int8_rows(head, tiny.weights[tiny.head_name()], "lm_head")
    assert isinstance(embed, QuantEmbedding)
    _assert_int8_rows(embed.head, tiny.weights["token_embd.weight"], "embed_tokens")
    assert (embed.head is head) is tiny.tied  # tied: one int8 matrix serves the lookup and the head


# -- the tokenizer ----------------------------------------------------------------------------------


def test_the_files_tokenizer_applies_its_merges_and_keeps_its_eos_whole(files):
    loaded = load(files["tied"].path, device="cpu", runner="torch")
    tokenizer = loaded.tokenizer
    ids = loaded.processor("the cat and the hat").token_ids
    # by the merges' ranks: "the" | "Ġc" "at" | "Ġ" "and" | "Ġthe" | "Ġ" "h" "at"
    assert [TOKENS[i] for i in ids] == ["the", "Ġc", "at", "Ġ", "and", "Ġthe", "Ġ", "h", "at"]
    assert tokenizer.decode(ids) == "the cat and the hat"
    assert tokenizer.eos_token_id == EOS_ID and loaded.eos_token_ids == (EOS_ID,)
    assert tokenizer.encode(EOS_TOKEN, add_special_tokens=False) == [EOS_ID]  # a control token


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_foveals_metadata_reader_and_tokenizer_equal_transformers(files, kind):
    """gguf.read_metadata (the fast reader the loader uses) gives what transformers' reader gives,
    string arrays in full or as counts, and the tokenizer built from it is transformers' own."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from foveal.engine.models import gguf as direct

    path = files[kind].path
    header = direct.read_header(path)
    for keep in ((), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")):
        assert direct.read_metadata(header, keep) == read_gguf_metadata(str(path), keep)[0]
    ours = direct.tokenizer(header)
    arch, vocabulary, config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, vocabulary)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    text = "the cat and the hat<|endoftext|> sat"
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.special_tokens_map == theirs.special_tokens_map and len(ours) == len(theirs)


# -- what a GGUF load imports, and the modules it builds ---------------------------------------------

# Modules a llama GGUF text model does not use, each of which a module-level import once pulled
# into `foveal.load`: transformers' modeling code (LlamaConfig's module imports it too), with torch's
# compiler, distributed tensors and sympy behind it, and the other families' model code.
NOT_IMPORTED = (
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.llama.configuration_llama",
    "transformers.models.qwen2_vl",
    "torch._dynamo",
    "torch.distributed.tensor",
    "sympy",
    "foveal.families.qwen_vl",
    "foveal.families.gemma4",
    "foveal.families.moondream",
)


def test_a_gguf_load_and_first_call_import_no_modeling_code_nor_other_families(files, tmp_path):
    """In a fresh process: foveal.load of a .gguf file and one call leave every module of
    `NOT_IMPORTED` unimported (before: all of them, 3.6 s of a 7.4 s load)."""
    script = (
        "import sys, foveal\n"
        f"model = foveal.load({str(files['tied'].path)!r}, device='cpu', runner='torch', max_model_len=128)\n"
        "model.generate(None, 'the cat', None, {'max_tokens': 3, 'temperature': 0.0})\n"
        "model.close()\n"
        f"print([m for m in {NOT_IMPORTED!r} if m in sys.modules or any(k.startswith(m + '.') for k in sys.modules)])\n"
    )
    env = {**os.environ, "FOVEAL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_models_rotary_is_transformers_llama_rotary_to_the_bit(files):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = load(files["tied"].path, device="cpu", runner="torch").runner.model
    theirs = LlamaRotaryEmbedding(files["tied"].reference().config)
    positions = torch.arange(0, 4096, 7)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for a, b in zip(model.get_decoder().rotary_emb(x, positions), theirs(x, positions), strict=True):
        assert torch.equal(a, b)
