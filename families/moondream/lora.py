"""LoRA variants of Moondream 2: resolving a variant, reading its adapter, and applying many per row.

PROBLEM
    `settings["variant"]` names a LoRA fine-tune of the text model. Requests with different
    variants, or none, share one engine step, so the adapter's delta must be applied per row of a
    flat batch (prefill rows, image prefix included, and decode rows alike), and rows without a
    variant must stay exactly the base model.
SOLUTION
    `resolve(name, folder)`: a variant is `<model folder>/variants/<name>.safetensors` (the layout
    the reference downloads), a path to such a file (.safetensors or the reference's `final.pt`),
    or the reference's cache `$HF_HUB_CACHE/md_variants/<name>/final.pt`; anything else is refused
    naming the places looked at. `read_adapter` checks the tensors by name and shape against the
    model (every module of every text block, rank equal within a module's A and B) and renames the
    reference's download names (`text_model.transformer.h.{i}.{mixer.Wqkv | mixer.out_proj |
    mlp.fc1 | mlp.fc2}.parametrizations.weight.0.{A,B}`) to (layer, module).
    `VariantBank` holds the loaded variants stacked per (layer, module): A_cat [sum r, in],
    B_cat [out, sum r] and the variant index of each rank column. For tokens whose variant index is
    v (0: none), delta = ((h A_cat^T) * [col == v]) B_cat^T: the other variants' columns are zeros,
    so a row gets exactly its own adapter, and a row without a variant gets an exact 0. The reference
    applies it without scaling: qkv(h) + d_qkv(h), proj(attn) + d_proj(h) (the proj adapter reads the
    block's LayerNorm output h, not the attention output), fc1(h) + d_fc1(h), fc2(g) + d_fc2(g).
    Loading a variant builds new stacks and swaps one reference (`snapshot`); a forward reads the
    snapshot once, so a variant loaded by a caller's thread mid-forward is seen from the next launch.
INVARIANTS
    - Indices are stable: a variant keeps its index while the runner lives (the KV pages of its
      requests are keyed by its identity, processor.py).
    - A variant is read once per identity (its resolved file and content digest).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

MODULES = ("qkv", "proj", "fc1", "fc2")
_REFERENCE_NAMES = {"mixer.Wqkv": "qkv", "mixer.out_proj": "proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}
_KEY = re.compile(r"text_model\.transformer\.h\.(\d+)\.(mixer\.Wqkv|mixer\.out_proj|mlp\.fc1|mlp\.fc2)"
                  r"\.parametrizations\.weight\.0\.(A|B)")
MAX_VARIANTS = 16


class VariantError(ValueError):
    """A variant that cannot be found or read; the message says where foveal looked and what to do."""


def cache_dir() -> Path:
    """The reference's variant cache: $HF_HUB_CACHE/md_variants (HF_HUB_CACHE as huggingface_hub sets it)."""
    hub = os.environ.get("HF_HUB_CACHE")
    if not hub:
        home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        hub = os.path.join(home, "hub")
    return Path(hub) / "md_variants"


def resolve(name: str, folder: Path | None) -> Path:
    """The file of a variant name or path (see the module docstring)."""
    candidates = []
    path = Path(name).expanduser()
    if path.suffix in (".safetensors", ".pt") or os.sep in name:
        candidates.append(path)
    else:
        if folder is not None:
            candidates.append(folder / "variants" / f"{name}.safetensors")
        candidates.append(cache_dir() / name / "final.pt")
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise VariantError(
        f"variant {name!r} was not found (looked at {looked}); put its adapter at <model folder>/variants/"
        f"{name}.safetensors or pass its file's path (foveal does not download variants)"
    )


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as file:
            return {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 - safe_open is not iterable
    try:  # the reference's download: a torch state dict; tensors only, no code (weights_only)
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:
        raise VariantError(f"{path} is not a readable variant ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VariantError(f"{path} is not a state dict of tensors; a variant file holds its LoRA A / B tensors")
    return state


def read_adapter(path: Path, n_layers: int, shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, str], tuple]:
    """{(layer, module): (A [r, in], B [out, r])} float32, checked against the model; `shapes` maps a
    module to its (in, out) features."""
    tensors = _read_tensors(path)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise VariantError(
                f"{path}: tensor {key!r} is not a LoRA tensor of Moondream's text model "
                "(text_model.transformer.h.<i>.<mixer.Wqkv|mixer.out_proj|mlp.fc1|mlp.fc2>.parametrizations.weight.0.<A|B>)"
            )
        layer, module, half = int(match[1]), _REFERENCE_NAMES[match[2]], match[3]
        found.setdefault((layer, module), {})[half] = tensor
    adapter = {}
    for layer in range(n_layers):
        for module in MODULES:
            pair = found.pop((layer, module), {})
            if set(pair) != {"A", "B"}:
                raise VariantError(f"{path} lacks the LoRA A and B of block {layer}'s {module}; every module of "
                                   "every text block must be present")
            a, b = pair["A"], pair["B"]
            fan_in, fan_out = shapes[module]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
                raise VariantError(
                    f"{path}: block {layer}'s {module} has A {list(a.shape)} and B {list(b.shape)}; this model needs "
                    f"A [rank, {fan_in}] and B [{fan_out}, rank]"
                )
            adapter[(layer, module)] = (a.float(), b.float())
    ranks = {a.shape[0] for a, _ in adapter.values()}
    if len(ranks) > 1:
        raise VariantError(f"{path}: its modules have different LoRA ranks {sorted(ranks)}; foveal needs one rank")
    if found:
        extra = sorted(found)[0]
        raise VariantError(f"{path} has LoRA tensors for block {extra[0]} beyond this model's {n_layers} text blocks")
    return adapter


@dataclass(frozen=True, slots=True)
class Stacks:
    """The loaded variants, stacked per (layer, module): A_cat [R, in], B_cat [out, R], col [R] variant index."""

    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]
    col: torch.Tensor
    count: int


class VariantBank:
    """The runner's variants: index 1.. per identity, and the current `Stacks` snapshot (None: none loaded)."""

    def __init__(self, n_layers: int, shapes: dict[str, tuple[int, int]], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.n_layers, self.shapes, self.device, self.dtype = n_layers, shapes, device, dtype
        self.snapshot: Stacks | None = None
        self._index: dict[str, int] = {}
        self._adapters: list[dict] = []
        self._lock = threading.Lock()

    def load(self, path: Path) -> tuple[int, str]:
        """(index, identity) of the variant in `path`, read and stacked on first use."""
        identity = f"{path}@{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
        with self._lock:
            if identity in self._index:
                return self._index[identity], identity
            if len(self._adapters) >= MAX_VARIANTS:
                raise VariantError(f"this model holds {MAX_VARIANTS} variants already; load the model again to use others")
            adapter = read_adapter(path, self.n_layers, self.shapes)
            self._adapters.append(adapter)
            self._index[identity] = len(self._adapters)
            self.snapshot = self._stack()
            return self._index[identity], identity

    def _stack(self) -> Stacks:
        a, b = {}, {}
        for key in self._adapters[0]:
            a[key] = torch.cat([ad[key][0] for ad in self._adapters]).to(self.device, self.dtype)
            b[key] = torch.cat([ad[key][1] for ad in self._adapters], dim=1).to(self.device, self.dtype)
        ranks = [ad[(0, "qkv")][0].shape[0] for ad in self._adapters]
        col = torch.cat([torch.full((r,), i + 1, dtype=torch.int64) for i, r in enumerate(ranks)]).to(self.device)
        return Stacks(a, b, col, len(self._adapters))


def delta(stacks: Stacks, key: tuple[int, str], x: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """The LoRA delta of module `key` for inputs x [T, in]; `select` [T, R] is 1 where the column is the
    token's variant (from `selector`)."""
    return ((x @ stacks.a[key].t()) * select) @ stacks.b[key].t()


def selector(stacks: Stacks, token_variant: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, R] (dtype): 1 where rank column r belongs to the token's variant, else 0 (variant 0: a zero row)."""
    return (token_variant[:, None] == stacks.col[None, :]).to(dtype)
