"""Moondream's tokenizer: the folder's `tokenizer.json` when it is the model's vocabulary, else
`moondream/starmie-v1` from the Hugging Face cache; region values spelled as text.

The real `vikhyatk/moondream2` folder reportedly ships an older GPT-2 style tokenizer that the
current model does not read (its id 0 is "!", where the model's is `<|endoftext|>`). A folder's
tokenizer is taken as the model's vocabulary when the configured eos id is a special token of it
and it fits the model's vocabulary; otherwise starmie-v1 is looked up in the local Hugging Face
cache (downloaded only when online, through huggingface_hub; never any code).

`MoondreamTokenizer` decodes region-value ids (past the vocabulary, see region.py) as
`<coord N>` / `<size W H>` (their bins), so the engine's detokenizer gives a detect answer a text
the skill parses back exactly. It sets `spells_values`, which makes the engine's detokenizer use
this `decode` rather than the native backend (that does not know these ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from foveal.engine.models.arch import ModelLoadError

from .region import value_of

STARMIE = "moondream/starmie-v1"


class MoondreamTokenizer(PreTrainedTokenizerFast):
    spells_values = True
    value_base = 51200  # set per instance to the model's vocabulary size

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if all(i < self.value_base for i in ids):
            return super()._decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        parts, run = [], []
        for i in ids:
            if i < self.value_base:
                run.append(i)
                continue
            if run:
                parts.append(
                    super()._decode(
                        run, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
                    )
                )
                run = []
            parts.append(spell(self.value_base, i))
        if run:
            parts.append(
                super()._decode(
                    run, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
                )
            )
        return "".join(parts)


def spell(vocab_size: int, value_id: int) -> str:
    kind, bins = value_of(vocab_size, value_id)
    return f"<{kind} {' '.join(map(str, bins))}>"


def load_tokenizer(folder: Path, vocab_size: int, eos_id: int) -> MoondreamTokenizer:
    own = folder / "tokenizer.json"
    if own.is_file():
        tokenizer = _from_file(own, vocab_size)
        if _is_model_vocabulary(tokenizer, vocab_size, eos_id):
            return _finish(tokenizer, vocab_size, eos_id)
    return _finish(_from_file(_starmie_file(folder), vocab_size), vocab_size, eos_id)


def _from_file(path: Path, vocab_size: int) -> MoondreamTokenizer:
    tokenizer = MoondreamTokenizer(tokenizer_file=str(path), clean_up_tokenization_spaces=False)
    tokenizer.value_base = vocab_size
    return tokenizer


def _is_model_vocabulary(tokenizer: MoondreamTokenizer, vocab_size: int, eos_id: int) -> bool:
    added = tokenizer.added_tokens_decoder
    return len(tokenizer) <= vocab_size and eos_id in added and added[eos_id].special


def _finish(tokenizer: MoondreamTokenizer, vocab_size: int, eos_id: int) -> MoondreamTokenizer:
    if len(tokenizer) > vocab_size:
        raise ModelLoadError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab_size}")
    eos = tokenizer.convert_ids_to_tokens(eos_id)
    tokenizer.eos_token = eos
    tokenizer.bos_token = eos
    return tokenizer


def _starmie_file(folder: Path) -> Path:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import LocalEntryNotFoundError
    except ImportError as error:  # pragma: no cover - huggingface_hub comes with transformers
        raise ModelLoadError("loading Moondream's tokenizer needs huggingface_hub") from error
    try:
        return Path(hf_hub_download(STARMIE, "tokenizer.json", local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(hf_hub_download(STARMIE, "tokenizer.json"))
    except Exception as error:
        raise ModelLoadError(
            f"{folder}'s tokenizer.json is not Moondream 2's vocabulary and {STARMIE} is neither in the Hugging Face "
            f"cache nor downloadable now ({type(error).__name__}); run once online, or save starmie-v1's tokenizer.json "
            "into the folder"
        ) from None
