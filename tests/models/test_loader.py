"""The loader's sources and its errors: local folders, hub cache, pickle refusal, mismatches, dtypes."""

import json
import re
import shutil

import pytest
import torch

from foveal.engine.models import ModelLoadError, pages_for_budget
from foveal.families import load, supported_architectures
from foveal.testing import parity, tiny


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loaded_record_has_runner_tokenizer_processor_eos(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu")
    assert loaded.name == "llama"
    assert loaded.eos_token_ids == (loaded.tokenizer.eos_token_id,)
    prompt = loaded.processor("red circle")
    assert prompt.token_ids[0] == loaded.tokenizer.bos_token_id
    assert prompt.prefill is None
    assert loaded.runner.device == torch.device("cpu") and loaded.runner.dtype == torch.float32


def test_pickle_only_folder_is_refused_with_conversion_hint(checkpoints, tmp_path):
    folder = copy(checkpoints["llama"], tmp_path / "pickled")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read: foveal never unpickles")
    with pytest.raises(ModelLoadError, match=r"only pickled weights \(pytorch_model.bin\).*save_pretrained"):
        load(folder, device="cpu")


def test_missing_files_are_named(checkpoints, tmp_path):
    no_config = copy(checkpoints["llama"], tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(no_config, device="cpu")
    no_tokenizer = copy(checkpoints["llama"], tmp_path / "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load(no_tokenizer, device="cpu")
    no_image_processor = copy(checkpoints["llava"], tmp_path / "no_image_processor")
    for name in ("preprocessor_config.json", "processor_config.json"):
        (no_image_processor / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        load(no_image_processor, device="cpu")
    with pytest.raises(ModelLoadError, match="neither a folder nor a hub id"):
        load(tmp_path / "does" / "not" / "exist", device="cpu")


def test_unknown_architecture_lists_supported_ones(checkpoints, tmp_path):
    folder = copy(checkpoints["llama"], tmp_path / "unknown")
    config = (folder / "config.json").read_text().replace('"LlamaForCausalLM"', '"MambaForCausalLM"')
    (folder / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="MambaForCausalLM") as err:
        load(folder, device="cpu")
    assert all(arch in str(err.value) for arch in supported_architectures())


def test_tokenizer_larger_than_vocabulary_is_refused(checkpoints, tmp_path, smollm2_dir):
    folder = copy(checkpoints["llama"], tmp_path / "mismatch")
    shutil.copy(smollm2_dir / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(smollm2_dir / "tokenizer_config.json", folder / "tokenizer_config.json")
    with pytest.raises(ModelLoadError, match="tokenizer has 49152 tokens but the model's vocabulary has"):
        load(folder, device="cpu")


def hub_cache(root, repo_id, snapshot_of):
    """A cache directory laid out as huggingface_hub's: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(snapshot_of, repo / "snapshots" / commit)
    return root


def test_hub_id_resolves_through_the_cache(checkpoints, tmp_path, monkeypatch):
    cache = hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", checkpoints["llama"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load("tiny-org/tiny-llama", device="cpu")
    assert loaded.name == "llama"
    assert "snapshots" in str(loaded.runner.model.name_or_path)


def test_hub_id_offline_without_cached_copy_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*hf download tiny-org/missing"):
        load("tiny-org/missing", device="cpu")


def test_dtype_and_device_errors(checkpoints):
    with pytest.raises(ModelLoadError, match="dtype 'float8'"):
        load(checkpoints["llama"], device="cpu", dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            load(checkpoints["llama"], device="cuda")


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "device='tpu' is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("mps", "device='mps' is not supported: foveal runs models on 'cpu' or 'cuda'"),
        (torch.device("meta"), "is not supported"),
        (0.5, "device must be a str or torch.device"),
    ],
)
def test_devices_foveal_cannot_run_on_are_refused_in_one_line_before_loading(
    checkpoints, monkeypatch, device, message
):
    """Was a raw torch RuntimeError ('Expected one of cpu, cuda, ipu, ...'), or for mps a failure after reading the weights."""
    from foveal.engine.models import loader

    monkeypatch.setattr(
        loader, "load_transformers", lambda *a: pytest.fail("weights read before the device was checked")
    )
    with pytest.raises(ModelLoadError, match=re.escape(message)) as caught:
        load(checkpoints["llama"], device=device)
    assert "\n" not in str(caught.value)


def test_a_cuda_index_torch_does_not_see_is_refused(checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError, match=r"device='cuda:3': torch sees 1 CUDA device\(s\)"):
        load(checkpoints["llama"], device="cuda:3")


def test_sdk_load_refuses_an_unknown_device_with_a_model_load_error():
    import foveal

    with pytest.raises(foveal.ModelLoadError, match="device='tpu' is not a device"):
        foveal.load(device="tpu")


@pytest.mark.parametrize(
    ("family", "expected"),
    # 2 (K and V) x layers x kv heads x head dim x 4 bytes (fp32)
    [("llama", 2 * 2 * 2 * 16 * 4), ("gemma", 2 * 2 * 1 * 16 * 4), ("paligemma", 2 * 2 * 1 * 16 * 4)],
)
def test_kv_bytes_per_token_and_budget(family, expected, checkpoints):
    runner = load(checkpoints[family], device="cpu").runner
    assert runner.kv_bytes_per_token() == expected
    assert pages_for_budget(runner, budget_bytes=expected * 16 * 10 + 5, page_size=16) == 10
    with pytest.raises(ValueError, match="holds no page"):
        pages_for_budget(runner, budget_bytes=expected, page_size=16)


def test_bf16_on_cpu_halves_kv_and_stays_close_to_fp32(checkpoints):
    fp32 = load(checkpoints["llama"], device="cpu")
    bf16 = load(checkpoints["llama"], device="cpu", dtype="bfloat16")
    assert bf16.runner.kv_bytes_per_token() * 2 == fp32.runner.kv_bytes_per_token()
    prompts = [fp32.processor(p) for p in tiny.PROMPTS]
    a = parity.greedy(fp32.runner, prompts, 1).logits
    b = parity.greedy(bf16.runner, prompts, 1).logits
    for x, y in zip(a, b, strict=True):
        assert y[0].dtype == torch.float32
        assert (x[0] - y[0]).abs().max() < 0.05 * x[0].abs().max()


def test_default_budget_is_a_fraction_of_available_memory():
    from foveal.engine.models import default_budget_bytes

    quarter = default_budget_bytes(torch.device("cpu"))
    half = default_budget_bytes(torch.device("cpu"), fraction=0.5)
    assert 0 < quarter < half


def test_remote_code_folder_is_refused_without_running_it(checkpoints, tmp_path):
    folder = copy(checkpoints["llama"], tmp_path / "remote")
    config = json.loads((folder / "config.json").read_text())
    config.update(
        architectures=["EvilForCausalLM"], model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"}
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError, match="unsupported architecture.*EvilForCausalLM"):
        load(folder, device="cpu")


def test_image_inputs_path_bytes_and_array_equal_pil(checkpoints, tmp_path):
    import numpy as np

    processor = load(checkpoints["llava"], device="cpu").processor
    image = tiny.images(1)[0]
    image.save(tmp_path / "im.png")
    expected = processor("what is this?", image)
    for other in (tmp_path / "im.png", (tmp_path / "im.png").read_bytes(), np.asarray(image)):
        got = processor("what is this?", other)
        assert got.token_ids == expected.token_ids
        assert torch.equal(
            got.prefill.image_tensors["pixel_values"], expected.prefill.image_tensors["pixel_values"]
        )
    with pytest.raises(TypeError, match="HxWx3 uint8 array"):
        processor("what is this?", 42)
    with pytest.raises(ValueError, match="text-only model; call it with image=None"):
        load(checkpoints["llama"], device="cpu").processor("hi", image)


@pytest.mark.parametrize("key", ["sliding_window", "attn_logit_softcapping"])
def test_attention_variants_not_implemented_are_refused(key, checkpoints, tmp_path):
    folder = copy(checkpoints["paligemma"], tmp_path / key)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"][key] = 4096 if key == "sliding_window" else 50.0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{key}=.*does not implement"):
        load(folder, device="cpu")


def test_hub_id_not_cached_is_downloaded_without_pickles(checkpoints, tmp_path, monkeypatch):
    """The online branch: a cache miss downloads the folder (safetensors/JSON/tokenizer patterns only)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def fake_snapshot_download(repo_id, cache_dir=None, local_files_only=False, allow_patterns=None, revision=None):
        calls.append((repo_id, local_files_only, allow_patterns))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(checkpoints["llama"])

    monkeypatch.setattr("foveal.engine.models.hub.snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert load("tiny-org/tiny-llama", device="cpu").name == "llama"
    (_, cached_only, _), (_, _, patterns) = calls
    assert cached_only
    assert "*.safetensors" in patterns and not any(p.endswith((".bin", ".pt", ".pth")) for p in patterns)
