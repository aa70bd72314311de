"""Moondream 3 fine-tune adapters (`settings["adapter"]`, lora.py) on the moondream3-tiny fixture's weights.

The fixture records no adapter (the preview's HF code has LoRA on attention and dense MLPs only, and no
checkpoint in that format was published), so the adapters are built here in Moondream's engine's format
(`lora_state_dict` with `text_lora.dense.*` / `text_lora.moe.*`), and checked against what they mean:
an adapter whose B factors are zero gives the base model's answers; a nonzero one gives the answers, and
the logits, of the base model with its change of weights merged into the checkpoint (dense fc1 / fc2
and every expert's fc1 / fc2); calls with different adapters and none share the engine's batches and
the image's pages and still answer as they do alone.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import foveal
from foveal.families.base import UnsupportedSkill
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.lora import VariantError
from foveal.families.moondream.processor import MoondreamProcessor, MoondreamPrompt

from .md3 import IMAGES, TOLERANCE
from .test_md3_parity import Driver

OBJECT = "tok1011 tok77"
QUESTION = "tok1012 tok318 tok428 tok30"
TEXT = {"max_tokens": 8}
RANK = 4  # 2 per expert: the tiny config routes each token to 2 experts
ADAPTERS = {"ft1@10": (1, 0.5), "ft1@20": (2, 0.5), "zero@1": (3, None)}  # id: (seed, B scale; None: zero B)


def text_config(md3_dir):
    return MoondreamConfig.from_dict(json.loads((md3_dir / "config.json").read_text())["config"], 3).text


def adapter_state(cfg, seed: int, scale: float | None, rank: int = RANK) -> dict[str, torch.Tensor]:
    """A random adapter in Moondream's format: A ~ N(0, 1/fan_in), B ~ N(0, scale^2) (zero when None)."""
    g = torch.Generator().manual_seed(seed)
    moe, dim, ff = cfg.moe, cfg.dim, cfg.ff_dim
    e, inner, per = moe.num_experts, moe.expert_inner_dim, rank // moe.experts_per_token

    def a(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def b(*shape):
        return torch.randn(*shape, generator=g) * (scale or 0.0)

    state = {}
    for i in range(moe.start_layer):
        state |= {f"text_lora.dense.{i}.up_a": a(rank, dim), f"text_lora.dense.{i}.up_b": b(ff, rank),
                  f"text_lora.dense.{i}.down_a": a(rank, ff), f"text_lora.dense.{i}.down_b": b(dim, rank)}
    for j in range(cfg.n_layers - moe.start_layer):
        state |= {f"text_lora.moe.{j}.up_a": a(e, per, dim), f"text_lora.moe.{j}.up_b": b(e, 2 * inner, per),
                  f"text_lora.moe.{j}.down_a": a(e, per, inner), f"text_lora.moe.{j}.down_b": b(e, dim, per)}
    return state


def merged(weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The checkpoint with the adapter's change of weights merged in (float32): W + B A per module."""
    out = {name: t.float() for name, t in weights.items()}
    start = cfg.moe.start_layer
    for layer in range(cfg.n_layers):
        kind, index = ("dense", layer) if layer < start else ("moe", layer - start)
        for module, half in (("fc1", "up"), ("fc2", "down")):
            a, b = state[f"text_lora.{kind}.{index}.{half}_a"], state[f"text_lora.{kind}.{index}.{half}_b"]
            out[f"model.text.blocks.{layer}.mlp.{module}.weight"] += b @ a  # [out, r] @ [r, in], per expert too
    return out


@pytest.fixture(scope="module")
def folders(md3_dir, tmp_path_factory):
    """The fixture with its adapters under adapters/<id>/<step>.pt, and for each nonzero adapter a
    folder whose weights have it merged in."""
    cfg = text_config(md3_dir)
    base = tmp_path_factory.mktemp("md3-adapters")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (base / name).symlink_to(md3_dir / name)
    weights = load_file(md3_dir / "model.safetensors")
    out = {"base": base}
    for adapter, (seed, scale) in ADAPTERS.items():
        finetune, step = adapter.split("@")
        state = adapter_state(cfg, seed, scale)
        (base / "adapters" / finetune).mkdir(parents=True, exist_ok=True)
        torch.save({"lora_state_dict": state, "step": int(step)}, base / "adapters" / finetune / f"{step}.pt")
        if scale is not None:
            folder = tmp_path_factory.mktemp(f"md3-merged-{finetune}-{step}")
            for name in ("config.json", "tokenizer.json"):
                (folder / name).symlink_to(md3_dir / name)
            save_file(merged(weights, state, cfg), folder / "model.safetensors")
            out[adapter] = folder
    return out


@pytest.fixture(scope="module")
def model(folders):
    with foveal.load(folders["base"]) as loaded:
        yield loaded


def answers(model, md3_dir, name, adapter=None):
    settings = {"adapter": adapter} if adapter else {}
    image = md3_dir / "images" / f"{name}.png"
    return {
        "caption": model.caption(image, settings={**TEXT, **settings})["caption"],
        "query": model.query(image, QUESTION, settings={**TEXT, **settings})["answer"],
        "point": model.point(image, OBJECT, settings={"max_objects": 3, **settings})["points"],
        "detect": model.detect(image, OBJECT, settings={"max_objects": 3, **settings})["objects"],
        "text_only": model.query(None, QUESTION, settings={**TEXT, **settings})["answer"],
    }


def unscored(result):
    """Answers without scores: a merged checkpoint's region heads read the same bins, but its scores are
    compared as floats below (the logits), not here."""
    return {k: [{n: v for n, v in item.items() if n != "score"} for item in value] if isinstance(value, list) else value
            for k, value in result.items()}


@pytest.mark.parametrize("name", IMAGES[:2])
def test_a_zero_adapter_is_the_base_model(model, md3_dir, name):
    assert answers(model, md3_dir, name, "zero@1") == answers(model, md3_dir, name)


@pytest.mark.parametrize("adapter", ["ft1@10", "ft1@20"])
@pytest.mark.parametrize("name", IMAGES[:2])
def test_an_adapter_is_its_merged_weights(model, folders, md3_dir, name, adapter):
    with foveal.load(folders[adapter]) as reference:
        want = answers(reference, md3_dir, name)
    got = answers(model, md3_dir, name, adapter)
    assert unscored(got) == unscored(want)
    assert unscored(got) != unscored(answers(model, md3_dir, name))  # the adapter does change the answers


def prompt_logits(runner, md3_dir, name, variant=(0, None), steps=3):
    """The caption prompt's last logits and `steps` greedy decode steps' on a private page pool."""
    processor = MoondreamProcessor(runner.config, None, runner.device, runner.dtype)
    template = runner.config.tokenizer.templates["caption"]["normal"]
    from PIL import Image

    image = Image.open(md3_dir / "images" / f"{name}.png")
    inputs = processor(MoondreamPrompt(tuple(template), variant=variant[0], variant_name=variant[1]), image)
    driver = Driver(runner)
    logits, _ = driver.run(inputs.token_ids, inputs.prefill)
    out = [logits]
    for _ in range(steps):
        logits, _ = driver.run([int(out[-1].argmax())])
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("name", IMAGES)
def test_logits_against_the_merged_weights(folders, md3_dir, name):
    """Float for float (the fixture's 1e-4 rule), prefill and decode rows: the adapter applied per row
    equals its weights merged; the zero adapter is the base within float summation order."""
    with foveal.load(folders["base"], pipelined=False) as model, foveal.load(folders["ft1@10"]) as ref:
        runner, ref_runner = model.family.runner, ref.family.runner
        runner.allocate_kv(128, 16)
        ref_runner.allocate_kv(128, 16)
        base = prompt_logits(runner, md3_dir, name)
        for adapter, want in (("zero@1", base), ("ft1@10", prompt_logits(ref_runner, md3_dir, name))):
            variant = runner.variants.load(folders["base"] / "adapters" / f"{adapter.replace('@', '/')}.pt")
            got = prompt_logits(runner, md3_dir, name, variant)
            assert float((got - want).abs().max()) <= (1e-5 if adapter == "zero@1" else TOLERANCE), adapter
        assert float((got - base).abs().max()) > 0.1  # the nonzero adapter moves the logits


def test_adapters_and_the_base_share_the_batch(model, md3_dir):
    """Calls with two adapters, the zero one and none at once, on the same images, answer as alone
    (rows of different adapters in one launch; pages keyed by the adapter, never shared across)."""
    calls = {(name, adapter): None for name in IMAGES[:2] for adapter in (None, "ft1@10", "ft1@20", "zero@1")}
    alone = {key: answers(model, md3_dir, *key) for key in calls}
    got: dict = {}
    threads = [threading.Thread(target=lambda key=key: got.__setitem__(key, answers(model, md3_dir, *key)))
               for key in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == alone
    assert alone[(IMAGES[0], "ft1@10")] != alone[(IMAGES[0], "ft1@20")]


def test_files_and_names(model, folders, md3_dir, tmp_path):
    """A path (.pt or .safetensors), the `_text.` prefix LoRA.state_dict() also writes, and the vision
    adapter Moondream's engine does not apply (skipped) give the same adapter."""
    cfg = text_config(md3_dir)
    state = adapter_state(cfg, *ADAPTERS["ft1@10"])
    image = md3_dir / "images" / f"{IMAGES[0]}.png"
    want = model.caption(image, settings={**TEXT, "adapter": "ft1@10"})["caption"]
    save_file(state, tmp_path / "flat.safetensors")
    both = {**state, **{"_text." + k.removeprefix("text_lora."): v for k, v in state.items()},
            "vision_lora.proj_fc2.down": torch.zeros(RANK, 128), "vision_lora.proj_fc2.up": torch.ones(128, RANK)}
    torch.save({"lora_state_dict": both}, tmp_path / "both.pt")
    for path in (tmp_path / "flat.safetensors", tmp_path / "both.pt"):
        assert model.caption(image, settings={**TEXT, "adapter": str(path)})["caption"] == want


def test_refusals(model, md3_dir, tmp_path, shared_dir):
    image = md3_dir / "images" / f"{IMAGES[0]}.png"

    def refused(adapter, match, error=VariantError):
        with pytest.raises(error, match=match):
            model.caption(image, settings={**TEXT, "adapter": adapter})

    refused("nope@3", r"adapter 'nope@3' was not found \(looked at .*adapters/nope/3\.pt, .*adapters/nope/3\.safetensors\)")
    refused("no-step", r"neither '<finetune_id>@<step>'")
    refused("a b@1", r"neither '<finetune_id>@<step>'")  # an id never holds a path: no "/", no spaces
    with pytest.raises(ValueError, match="setting 'adapter' = '' is not accepted"):
        model.caption(image, settings={"adapter": ""})
    cfg = text_config(md3_dir)
    state = adapter_state(cfg, 1, 0.5)
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "text_lora.moe.1.down_b"}, r"lacks text_lora\.moe\.1\.down_b"),
        "shape": ({**state, "text_lora.dense.1.up_b": torch.zeros(255, RANK)},
                  r"text_lora\.dense\.1\.up_b has shape \[255, 4\]; an adapter of rank 4 .* needs \[256, 4\]"),
        "split": ({**adapter_state(cfg, 1, 0.5, rank=2), **{k: v for k, v in state.items() if ".dense." in k}},
                  r"moe\.\d\.up_a has shape \[8, 1, 128\]; an adapter of rank 4 .* needs \[8, 2, 128\].*rank / 2 per expert"),
        "extra": ({**state, "text_lora.moe.2.up_a": state["text_lora.moe.0.up_a"]}, r"beyond this model's 2 moe layers"),
        "other": ({**state, "model.text.blocks.0.attn.qkv.lora_A": torch.zeros(4, 128)}, r"is not a LoRA tensor"),
    }
    for case, (tensors, match) in cases.items():
        torch.save({"lora_state_dict": tensors}, tmp_path / f"{case}.pt")
        refused(str(tmp_path / f"{case}.pt"), match)
    with pytest.raises(UnsupportedSkill, match=r"settings\['variant'\].*settings\['adapter'\]"):
        model.caption(image, settings={"variant": "x"})
    md2_folder = shared_dir / "fixtures" / "moondream2-tiny"
    if md2_folder.is_dir():
        with foveal.load(md2_folder) as md2, pytest.raises(UnsupportedSkill, match=r"use settings\['variant'\]"):
            md2.caption(md2_folder / "images" / "small_64x64.png", settings={"adapter": "ft1@10"})
