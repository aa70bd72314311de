"""The weight cache of GGUF loads (engine/models/weight_cache.py), on the tiny llama files of test_gguf_tiny.py.

A load writes the file's prepared weights and tokenizer to `$FOVEAL_CACHE/prepared`; the next load
of the same file and options builds its layers from that entry. Checked here:
  - a load from the entry holds the same weights, bit for bit, and decodes the same greedy tokens
    with the same logits as a load from the file, with the cache and without (`FOVEAL_WEIGHT_CACHE=0`),
    for the default kernels, "int4" and "int8"; and it does not prepare any weight from the file;
  - a damaged entry (a flipped byte in a tensor, a cut file, a damaged tokenizer file) is reported
    with a warning and never used: the weights come from the file, and the entry is written again;
  - a changed file (another mtime) or other options miss silently; an entry whose file is gone is
    pruned; a cache that cannot be written warns and the model loads all the same.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from foveal.engine.models import gguf as direct
from foveal.engine.models import weight_cache
from foveal.engine.models.processor import PromptInputs
from foveal.engine.models.quant import fp16_kernel_available
from foveal.families import load
from foveal.testing import parity
from tests.models.test_gguf_tiny import NEW_TOKENS, PROMPTS, write_tiny_gguf

MODES = [None, "int4", "int8"] if fp16_kernel_available() else ["int4", "int8"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root for the test, the cache on."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FOVEAL_CACHE", str(root))
    monkeypatch.delenv("FOVEAL_WEIGHT_CACHE", raising=False)
    return root / "prepared"


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf", tied=False, seed=0)


def _entries(folder):
    return sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def _greedy(loaded):
    """Greedy tokens and logits, every launch eager: a decode step replays a traced graph only once
    its background trace is done (traced.py), whose logits may differ from eager ones in the last
    bit; and a trace silences warnings process-wide while it runs, which would hide the cache's."""
    loaded.runner.decode_graphs = None
    out = parity.greedy(loaded.runner, [PromptInputs(list(ids), None) for ids in PROMPTS], NEW_TOKENS, ())
    return out.tokens, out.logits


def _weights(loaded) -> dict[str, torch.Tensor]:
    """Every weight the model multiplies or looks up by, as the kernels see it (int4 and fp16 halves apart)."""
    model = loaded.runner.model
    out = {"embed": model.get_decoder().embed_tokens.weight.float(), "head": model.lm_head.dequantize()}
    for name, module in model.named_modules():
        if hasattr(module, "int4"):  # a SplitLinear: both halves
            out[f"{name}.int4"] = module.int4.dequantize()
            out[f"{name}.fp16"] = module.fp16.dequantize()
        elif hasattr(module, "dequantize"):
            out[name] = module.dequantize()
        elif name.endswith("layernorm") or name.endswith("norm"):
            out[name] = module.weight
    return out


def _assert_same_model(a, b) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    tokens_a, logits_a = _greedy(a)
    tokens_b, logits_b = _greedy(b)
    assert tokens_a == tokens_b
    for x, y in zip(logits_a, logits_b, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def _forbid_building(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was prepared from the file although the cache holds it")

    monkeypatch.setattr(direct, "prepare", refuse)
    monkeypatch.setattr(direct, "tokenizer_source", refuse)


@pytest.mark.parametrize("quantize", MODES)
def test_a_load_from_the_cache_is_the_load_from_the_file(cache, tiny, quantize, monkeypatch):
    first = load(tiny.path, device="cpu", runner="torch", quantize=quantize)  # from the file; writes the entry
    assert len(_entries(cache)) == 1
    with monkeypatch.context() as patch:
        _forbid_building(patch)
        again = load(tiny.path, device="cpu", runner="torch", quantize=quantize)  # from the entry
    monkeypatch.setenv("FOVEAL_WEIGHT_CACHE", "0")
    without = load(tiny.path, device="cpu", runner="torch", quantize=quantize)
    _assert_same_model(again, first)
    _assert_same_model(again, without)
    text = "the cat and the hat"
    assert again.tokenizer(text).input_ids == without.tokenizer(text).input_ids
    assert again.tokenizer.special_tokens_map == without.tokenizer.special_tokens_map
    assert again.eos_token_ids == without.eos_token_ids


def test_the_cache_can_be_turned_off(cache, tiny, monkeypatch):
    monkeypatch.setenv("FOVEAL_WEIGHT_CACHE", "0")
    load(tiny.path, device="cpu", runner="torch")
    assert _entries(cache) == []


def _damage_a_tensor(entry) -> None:
    """Flip one byte inside the tensor data (past the safetensors header)."""
    data = bytearray(entry.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x5A
    entry.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        _damage_a_tensor,
        lambda entry: entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2]),
        lambda entry: weight_cache.tokenizer_path(entry).write_text('{"version": "1.0", "model": {}}'),
    ],
    ids=["flipped-byte", "cut-file", "tokenizer"],
)
def test_a_damaged_entry_is_reported_never_used_and_written_again(cache, tiny, damage, monkeypatch):
    monkeypatch.setenv("FOVEAL_WEIGHT_CACHE", "0")
    reference = load(tiny.path, device="cpu", runner="torch")
    monkeypatch.delenv("FOVEAL_WEIGHT_CACHE")
    load(tiny.path, device="cpu", runner="torch")
    (entry,) = cache.glob("*.safetensors")
    damage(entry)
    with pytest.warns(UserWarning, match="weight cache entry .* is damaged"):
        rebuilt = load(tiny.path, device="cpu", runner="torch")
    _assert_same_model(rebuilt, reference)
    with warnings.catch_warnings(), monkeypatch.context() as patch:
        warnings.simplefilter("error")  # the entry written again is whole
        _forbid_building(patch)
        _assert_same_model(load(tiny.path, device="cpu", runner="torch"), reference)


def test_a_changed_file_or_build_or_other_options_miss_silently_and_replace_their_own_entry(
    cache, tiny, monkeypatch
):
    load(tiny.path, device="cpu", runner="torch", quantize="int8")
    (before,) = cache.glob("*.safetensors")
    written = before.stat().st_mtime_ns
    stat = tiny.path.stat()
    os.utime(tiny.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tiny.path, device="cpu", runner="torch", quantize="int8")
    assert _entries(cache) == [before.name] and before.stat().st_mtime_ns != written  # replaced
    monkeypatch.setattr(weight_cache, "FORMAT", weight_cache.FORMAT + 1)  # foveal (or torch) changed
    written = before.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tiny.path, device="cpu", runner="torch", quantize="int8")
    assert _entries(cache) == [before.name] and before.stat().st_mtime_ns != written  # replaced in place
    load(tiny.path, device="cpu", runner="torch", quantize="int4")
    assert len(_entries(cache)) == 2  # one entry per (file, options)


def test_entries_of_removed_files_are_pruned(cache, tiny, tmp_path):
    other = write_tiny_gguf(tmp_path / "other.gguf", tied=True, seed=1)
    load(other.path, device="cpu", runner="torch", quantize="int8")
    other.path.unlink()
    load(tiny.path, device="cpu", runner="torch", quantize="int8")
    assert [name.split("-")[0] for name in _entries(cache)] == ["tiny"]
    assert [p.name.split("-")[0] for p in cache.glob("*.tokenizer.json")] == ["tiny"]


def test_a_cache_that_cannot_be_written_warns_and_the_model_loads(tmp_path, tiny, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FOVEAL_CACHE", str(blocker))
    monkeypatch.delenv("FOVEAL_WEIGHT_CACHE", raising=False)
    with pytest.warns(UserWarning, match="could not write its weight cache entry"):
        loaded = load(tiny.path, device="cpu", runner="torch", quantize="int8")
    monkeypatch.setenv("FOVEAL_WEIGHT_CACHE", "0")
    _assert_same_model(loaded, load(tiny.path, device="cpu", runner="torch", quantize="int8"))
