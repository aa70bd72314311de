"""Which tokenizer a Moondream folder gets: its own when it is the model's vocabulary, else starmie-v1
from the Hugging Face cache (never a download when offline); region values spelled as text."""

from __future__ import annotations

import huggingface_hub.constants
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from foveal.engine.models import ModelLoadError
from foveal.families.moondream.region import coord_id, size_id
from foveal.families.moondream.tokenizer import load_tokenizer
from foveal.testing import moondream


def test_own_vocabulary_is_used_and_spells_values(tmp_path):
    folder = moondream.build(tmp_path / "md")
    tokenizer = load_tokenizer(folder, moondream.VOCAB, 0)
    assert tokenizer.eos_token_id == 0
    v = moondream.VOCAB
    text = tokenizer.decode([coord_id(v, 265), coord_id(v, 948), size_id(v, 549, 654)])
    assert text == "<coord 265><coord 948><size 549 654>"
    assert tokenizer.decode([0], skip_special_tokens=False) == "<|endoftext|>"


def test_gpt2_style_tokenizer_falls_back_to_starmie_offline(tmp_path, monkeypatch):
    """A folder whose tokenizer's id 0 is not Moondream's special <|endoftext|> (the GPT-2 style file of the
    real repository) is not the model's vocabulary: starmie-v1 is looked up, and offline without it the
    load fails saying what to do."""
    folder = moondream.build(tmp_path / "md")
    old = Tokenizer(models.WordLevel({"!": 0, '"': 1, "a": 2, "<unk>": 3}, unk_token="<unk>"))
    old.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    old.save(str(folder / "tokenizer.json"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="starmie-v1"):
        load_tokenizer(folder, moondream.VOCAB, 0)
