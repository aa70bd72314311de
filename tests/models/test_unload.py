"""load -> call -> close frees the model's weights (issue 13: +20 MB per cycle with the embedded
model, +650 MB with SmolLM2, before engine/models/traced.py traced into a compilation unit of its own).

The check is on storages, not RSS: a weak reference to each weight's storage (the C++ memory, not
the Python Parameter, which died even when the leak was there) must expire once the model is
closed, dropped and collected. benchmarks/leaks.py measures the RSS side.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.jit._state
from torch.multiprocessing.reductions import StorageWeakRef

import foveal
from foveal.engine.models.traced import own_compilation_unit
from foveal.vision import scenes


def _global_traces() -> int:
    return len(torch.jit._state._python_cu.get_functions())


def _load_call_close(image) -> list[StorageWeakRef]:
    model = foveal.load()
    weights = [StorageWeakRef(p.untyped_storage()) for p in model.family.runner.model.parameters()]
    model.generate(image, "hi", settings={"max_tokens": 6})  # prefill + decode steps, traced beside them
    model.family.runner.decode_graphs.wait()
    assert model.family.runner.decode_graphs.graphs, "a decode step should have been traced"
    model.close()
    return weights


def test_load_call_close_frees_every_weight_storage():
    image = scenes.render(scenes.generate_scene(1))
    traces_before = _global_traces()
    for _ in range(2):
        weights = _load_call_close(image)
        gc.collect()
        alive = sum(not w.expired() for w in weights)
        assert alive == 0, f"{alive} of {len(weights)} weight storages outlived close() + gc"
    assert _global_traces() == traces_before, "a decode trace stayed in torch's process-wide unit"


def test_own_compilation_unit_restores_the_global_unit_even_on_error():
    saved = torch.jit._state._python_cu
    with pytest.raises(ValueError), own_compilation_unit() as unit:
        assert torch.jit._state._python_cu is unit
        raise ValueError("trace failed")
    assert torch.jit._state._python_cu is saved


def test_a_trace_inside_own_compilation_unit_outlives_the_block():
    before = _global_traces()
    with own_compilation_unit() as unit, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated in torch 2.9+
        graph = torch.jit.trace(torch.nn.Linear(3, 2), torch.randn(1, 3))
    del unit
    assert _global_traces() == before
    assert graph(torch.ones(1, 3)).shape == (1, 2)  # the module keeps its unit alive
