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
MOONDREAM 3 ADAPTERS
    `settings["adapter"]` names a fine-tune of Moondream's API as its client does: `<finetune_id>@<step>`
    (the REST `model` `moondream3-preview/<finetune_id>@<step>`, moondream's `Finetune.model`), or a
    file's path. Its format is Moondream's engine's (kestrel: `models/moondream/lora.py`,
    `cloud/adapter_provider.py`, `lora_workspace.py`; read, not run): a torch checkpoint whose
    `lora_state_dict` holds `text_lora.dense.{i}.{up,down}_{a,b}` for the dense layers i <
    moe.start_layer and `text_lora.moe.{j}.{up,down}_{a,b}` for MoE layer start_layer + j (the same
    tensors may also appear under `_text.`, the other name `LoRA.state_dict()` gives them):
        dense up_a [r, dim], up_b [ff, r], down_a [r, ff], down_b [dim, r]   (fc1, fc2)
        moe   up_a [E, r/k, dim], up_b [E, 2 inner, r/k], down_a [E, r/k, inner], down_b [E, dim, r/k]
    with r the adapter's rank and k experts_per_token (the rank is split over the active experts).
    Only the MLPs carry LoRA: no attention, no router; the vision adapter (`vision_lora.*`) the
    format allows is not applied by Moondream's engine's adapter loader (it builds the adapter with
    vision=None), so foveal skips it too. Applied without scaling, as a change of the weights:
    fc1(h) + B A h, fc2(g) + B A g, and per routed expert e W1_e + B_e A_e, W2_e + B_e A_e (up_b's
    rows in the checkpoint's fc1 order: the GELU input half, then the gate half).
    `resolve_adapter` finds `<finetune_id>@<step>` at `<model folder>/adapters/<finetune_id>/<step>.pt`
    (the checkpoint as Moondream's API serves it) or `<step>.safetensors` (its `lora_state_dict`'s
    tensors); `AdapterBank` stacks adapters as `VariantBank` does: dense modules by rank columns,
    MoE modules by (adapter, expert) columns, so that each (token, expert) pair selects its own
    adapter's columns of its own expert; rows without one take the base layer's output unchanged.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from .config import TextConfig

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
    return _first_file(
        candidates,
        lambda looked: f"variant {name!r} was not found (looked at {looked}); put its adapter at <model folder>/"
        f"variants/{name}.safetensors or pass its file's path (foveal does not download variants)",
    )


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as file:
            return {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 - safe_open is not iterable
    state = _torch_checkpoint(path, "variant")  # the reference's download: a torch state dict
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

    def rows(self, token_variant: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What a forward needs of each token's variant: the [T, R] selector (`selector`)."""
        return (token_variant[:, None] == self.col[None, :]).to(dtype)


class _Bank:
    """A runner's adapters: index 1.. per identity (file and content digest), and the current stacks
    snapshot (None: none loaded). Subclasses read a file (`_read`) and stack the adapters (`_stack`)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.snapshot: Stacks | AdapterStacks | None = None
        self._index: dict[str, int] = {}
        self._adapters: list[dict] = []
        self._lock = threading.Lock()

    def load(self, path: Path) -> tuple[int, str]:
        """(index, identity) of the adapter in `path`, read and stacked on first use."""
        identity = f"{path}@{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
        with self._lock:
            if identity in self._index:
                return self._index[identity], identity
            if len(self._adapters) >= MAX_VARIANTS:
                raise VariantError(f"this model holds {MAX_VARIANTS} adapters already; load the model again to use others")
            adapter = self._read(path)
            self._adapters.append(adapter)
            self._index[identity] = len(self._adapters)
            self.snapshot = self._stack()
            return self._index[identity], identity

    def _read(self, path: Path) -> dict:
        raise NotImplementedError

    def _stack(self) -> Stacks | AdapterStacks:
        raise NotImplementedError


class VariantBank(_Bank):
    """Moondream 2's variants (`read_adapter`), stacked by rank columns."""

    def __init__(self, n_layers: int, shapes: dict[str, tuple[int, int]], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.n_layers, self.shapes = n_layers, shapes

    def _read(self, path: Path) -> dict:
        return read_adapter(path, self.n_layers, self.shapes)

    def _stack(self) -> Stacks:
        return _columns(self._adapters, list(self._adapters[0]), self.device, self.dtype)


def _columns(adapters: list[dict], keys: list, device: torch.device, dtype: torch.dtype) -> Stacks:
    """Adapters' (A [r, in], B [out, r]) per key stacked by rank columns, the column's adapter index in col."""
    a, b = {}, {}
    for key in keys:
        a[key] = torch.cat([ad[key][0] for ad in adapters]).to(device, dtype)
        b[key] = torch.cat([ad[key][1] for ad in adapters], dim=1).to(device, dtype)
    ranks = [ad[keys[0]][0].shape[0] for ad in adapters]
    col = torch.cat([torch.full((r,), i + 1, dtype=torch.int64) for i, r in enumerate(ranks)]).to(device)
    return Stacks(a, b, col, len(adapters))


def delta(stacks: Stacks, key: tuple[int, str], x: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """The LoRA delta of module `key` for inputs x [T, in]; `select` [T, R] is 1 where the column is the
    token's variant (from `selector`)."""
    return ((x @ stacks.a[key].t()) * select) @ stacks.b[key].t()


def selector(stacks: Stacks | AdapterStacks, token_variant: torch.Tensor, dtype: torch.dtype):
    """What the forward reads of each token's variant (variant 0: none): for Moondream 2 the [T, R]
    (dtype) selector, 1 where rank column r belongs to the token's variant, else 0; for Moondream 3
    `AdapterRows`."""
    return stacks.rows(token_variant, dtype)


# ---- Moondream 3: adapters of Moondream's API (see the module docstring) ------------------------------------

ADAPTER_ID = re.compile(r"([A-Za-z0-9_-][A-Za-z0-9._-]*)@([A-Za-z0-9_-][A-Za-z0-9._-]*)")
_ADAPTER_KEY = re.compile(r"(?:text_lora|_text)\.(dense|moe)\.(\d+)\.(up|down)_(a|b)")
_VISION_KEY = re.compile(r"(?:vision_lora|_vision)\..+")
ADAPTER_FILES = (".pt", ".safetensors")


def resolve_adapter(name: str, folder: Path | None) -> Path:
    """The file of `settings["adapter"]`: `<finetune_id>@<step>` under `<model folder>/adapters/`, or a path."""
    path = Path(name).expanduser()
    if path.suffix in ADAPTER_FILES or os.sep in name:
        candidates = [path]
    else:
        match = ADAPTER_ID.fullmatch(name)
        if match is None:
            raise VariantError(
                f"adapter {name!r} is neither '<finetune_id>@<step>' (as Moondream's API names a fine-tune's "
                "checkpoint) nor a path to an adapter file (.pt or .safetensors)"
            )
        if folder is None:
            raise VariantError(f"adapter {name!r}: this model has no folder to look in; pass the adapter file's path")
        finetune, step = match.groups()
        candidates = [folder / "adapters" / finetune / f"{step}{suffix}" for suffix in ADAPTER_FILES]
    return _first_file(
        candidates,
        lambda looked: f"adapter {name!r} was not found (looked at {looked}); put the checkpoint Moondream's API "
        "serves at <model folder>/adapters/<finetune_id>/<step>.pt or pass its file's path (foveal does not download "
        "adapters)",
    )


def _first_file(candidates: list[Path], missing: Callable[[str], str]) -> Path:
    """The first of `candidates` that is a file, resolved; else VariantError(missing(the places looked at))."""
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise VariantError(missing(", ".join(str(c) for c in candidates)))


def _adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A file's LoRA tensors: a .safetensors file's, or a torch checkpoint's `lora_state_dict` (or the
    checkpoint itself, when it is that state dict)."""
    state: object = _read_tensors(path) if path.suffix == ".safetensors" else _torch_checkpoint(path, "adapter")
    if isinstance(state, dict) and isinstance(state.get("lora_state_dict"), dict):
        state = state["lora_state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VariantError(f"{path} holds no LoRA state dict of tensors ('lora_state_dict' in Moondream's checkpoints)")
    return state


def _torch_checkpoint(path: Path, what: str) -> object:
    """A torch checkpoint's contents: tensors and plain containers only, no code (weights_only)."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:
        raise VariantError(f"{path} is not a readable {what} ({type(error).__name__}: {error})") from None


def adapter_shapes(cfg: TextConfig, rank: int, per_expert: int) -> dict[tuple[str, str], tuple[int, ...]]:
    """The shape of each (kind, tensor) of an adapter of `rank` (dense) and `per_expert` (MoE) columns."""
    assert cfg.moe is not None  # a Moondream 3 config
    e, inner, r, q = cfg.moe.num_experts, cfg.moe.expert_inner_dim, rank, per_expert
    return {
        ("dense", "up_a"): (r, cfg.dim), ("dense", "up_b"): (cfg.ff_dim, r),
        ("dense", "down_a"): (r, cfg.ff_dim), ("dense", "down_b"): (cfg.dim, r),
        ("moe", "up_a"): (e, q, cfg.dim), ("moe", "up_b"): (e, 2 * inner, q),
        ("moe", "down_a"): (e, q, inner), ("moe", "down_b"): (e, cfg.dim, q),
    }


def _lora_tensors(path: Path, counts: dict[str, int]) -> dict[tuple[str, int, str], torch.Tensor]:
    """{(kind, index, "up_a" | ...): tensor} of an adapter file, by its names (either prefix)."""
    found: dict[tuple[str, int, str], torch.Tensor] = {}
    for key, tensor in _adapter_tensors(path).items():
        if _VISION_KEY.fullmatch(key):
            continue  # the vision adapter, which Moondream's engine does not apply either
        match = _ADAPTER_KEY.fullmatch(key)
        if match is None:
            raise VariantError(
                f"{path}: tensor {key!r} is not a LoRA tensor of Moondream 3's text model "
                "(text_lora.<dense|moe>.<i>.<up|down>_<a|b>)"
            )
        kind, index, name = match[1], int(match[2]), f"{match[3]}_{match[4]}"
        if index >= counts[kind]:
            raise VariantError(f"{path}: {key} is beyond this model's {counts[kind]} {kind} layers")
        seen = found.setdefault((kind, index, name), tensor)
        if seen is not tensor and not torch.equal(seen, tensor):
            raise VariantError(f"{path}: {key} differs from the same tensor under the other prefix (_text / text_lora)")
    return found


def read_adapter3(path: Path, cfg: TextConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, "fc1" | "fc2" | "up" | "down"): (A, B)} float32, checked against the model: every dense
    and MoE layer's four tensors, of the shapes of one rank r (the first dense layer's), r / k per expert."""
    assert cfg.moe is not None  # a Moondream 3 config
    start, k = cfg.moe.start_layer, cfg.moe.experts_per_token
    counts = {"dense": start, "moe": cfg.n_layers - start}
    found = _lora_tensors(path, counts)
    for kind in ("dense", "moe"):
        for index in range(counts[kind]):
            for name in ("up_a", "up_b", "down_a", "down_b"):
                if (kind, index, name) not in found:
                    raise VariantError(f"{path} lacks text_lora.{kind}.{index}.{name}; every dense and MoE layer's "
                                       "up_a, up_b, down_a and down_b must be present")
    rank = found[("dense", 0, "up_a")].shape[0] if start else found[("moe", 0, "up_a")].shape[1] * k
    if rank % k:
        raise VariantError(f"{path}: rank {rank} is not a multiple of the {k} experts per token that share it")
    shapes = adapter_shapes(cfg, rank, rank // k)
    adapter = {}
    for (kind, index, name), tensor in found.items():
        if tuple(tensor.shape) != shapes[(kind, name)]:
            raise VariantError(
                f"{path}: text_lora.{kind}.{index}.{name} has shape {list(tensor.shape)}; an adapter of rank {rank} "
                f"(its first layer's) needs {list(shapes[(kind, name)])} (Moondream's adapters split the rank over "
                f"the {k} active experts: rank / {k} per expert)"
            )
    for kind in ("dense", "moe"):
        for index in range(counts[kind]):
            layer = index if kind == "dense" else start + index
            up, down = ("fc1", "fc2") if kind == "dense" else ("up", "down")
            a, b, c, d = (found[(kind, index, n)].float() for n in ("up_a", "up_b", "down_a", "down_b"))
            adapter[(layer, up)], adapter[(layer, down)] = (a, b), (c, d)
    return adapter


@dataclass(frozen=True, slots=True)
class AdapterStacks:
    """Moondream 3's loaded adapters: `dense` by rank columns (Moondream 2's `Stacks`, keys (layer,
    "fc1" | "fc2")); `moe` keys (layer, "up" | "down") with A_cat [C, in], B_cat [out, C], whose column
    c belongs to (adapter, expert) code `moe_code[c]` = adapter * experts + expert."""

    dense: Stacks
    moe: Stacks
    moe_code: torch.Tensor
    experts: int
    count: int

    def rows(self, token_variant: torch.Tensor, dtype: torch.dtype) -> AdapterRows:
        return AdapterRows(token_variant, self.dense.rows(token_variant, dtype), token_variant > 0)


@dataclass(frozen=True, slots=True)
class AdapterRows:
    """A launch's tokens as the adapters see them: [T] adapter index (0: none), the dense [T, R]
    selector, and [T] whether the token has an adapter."""

    variant: torch.Tensor
    dense: torch.Tensor
    adapted: torch.Tensor


class AdapterBank(_Bank):
    """Moondream 3's adapters (`read_adapter3`)."""

    def __init__(self, cfg: TextConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        assert cfg.moe is not None  # a Moondream 3 config
        self.cfg, self.experts = cfg, cfg.moe.num_experts

    def _read(self, path: Path) -> dict:
        return read_adapter3(path, self.cfg)

    def _stack(self) -> AdapterStacks:
        """Dense modules by rank columns; MoE modules by each adapter's experts' rank columns, in (expert,
        rank) order: A [E, r, in] -> [E r, in], B [E, out, r] -> [out, E r], column code v * E + e."""
        dense = self._stacked(lambda module: module in ("fc1", "fc2"), lambda a, b: (a, b))
        moe = self._stacked(lambda module: module in ("up", "down"),
                            lambda a, b: (a.reshape(-1, a.shape[-1]), b.permute(1, 0, 2).reshape(b.shape[1], -1)))
        per_expert = [next((a.shape[1] for (_, m), (a, _) in ad.items() if m == "up"), 0) for ad in self._adapters]
        code = [v * self.experts + e for v, r in enumerate(per_expert, 1) for e in range(self.experts) for _ in range(r)]
        return AdapterStacks(dense, moe, torch.tensor(code, dtype=torch.int64, device=self.device),
                             self.experts, len(self._adapters))

    def _stacked(self, keep, columns) -> Stacks:
        """`_columns` of the adapters' modules that `keep` names, each (A, B) made rank columns by `columns`."""
        adapters = [{key: columns(a, b) for key, (a, b) in ad.items() if keep(key[1])} for ad in self._adapters]
        keys = list(adapters[0])
        if not keys:  # a config without dense (or MoE) layers: nothing to select
            return Stacks({}, {}, torch.zeros(0, dtype=torch.int64, device=self.device), len(adapters))
        return _columns(adapters, keys, self.device, self.dtype)


def adapted_feed_forward(
    block, layer: int, h: torch.Tensor, base: torch.Tensor, stacks: AdapterStacks, rows: AdapterRows
) -> torch.Tensor:
    """A Moondream 3 block's MLP output with each token's adapter (text3.TextBlock3 `block`): adapted
    tokens get the layer with their adapter's change of weights, the others `base` (the block's own
    output for them) unchanged."""
    if block.is_moe:
        out = _adapted_moe(block.mlp, layer, h, stacks, rows)
    else:
        mlp, dense = block.mlp, stacks.dense
        g = F.gelu(mlp.fc1(h) + delta(dense, (layer, "fc1"), h, rows.dense), approximate="tanh")
        out = mlp.fc2(g) + delta(dense, (layer, "fc2"), g, rows.dense)
    return torch.where(rows.adapted[:, None], out, base)


def _adapted_moe(moe, layer: int, h: torch.Tensor, stacks: AdapterStacks, rows: AdapterRows) -> torch.Tensor:
    """moe.MoE's sum over each token's routed experts, every (token, expert) pair's expert changed by
    the token's adapter: u = W1_e x + B A x, y = W2_e geglu(u) + B A geglu(u)."""
    experts, weights = moe.route(h)  # routing is the base router's: adapters do not touch it
    k = experts.shape[1]
    expert = experts.reshape(-1)  # pair p = token * k + j
    token = torch.arange(h.shape[0], device=h.device).repeat_interleave(k)
    code = rows.variant.index_select(0, token) * stacks.experts + expert
    select = (code[:, None] == stacks.moe_code[None, :]).to(h.dtype)  # the pair's own columns
    x = h.index_select(0, token)
    u = _per_pair(moe.fc1.weight, x, expert) + delta(stacks.moe, (layer, "up"), x, select)
    act = moe._geglu(u)  # the MoE's own GeGLU (its exact GELU), not a copy
    y = _per_pair(moe.fc2.weight, act, expert) + delta(stacks.moe, (layer, "down"), act, select)
    y = y * weights.reshape(-1, 1)
    return torch.zeros_like(h).index_add_(0, token, y)


def _per_pair(weight: torch.Tensor, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """x[p] @ weight[expert[p]]^T for every pair p ([E, out, in] stacks): the pairs packed per expert into
    one [E, capacity, in] block and one bmm, as moe.MoE.grouped packs them (no loop per expert)."""
    num = weight.shape[0]
    order = expert.argsort(stable=True)
    sorted_expert = expert.index_select(0, order)
    counts = torch.bincount(expert, minlength=num)
    capacity = int(counts.max())  # a host read: the block's width
    slot = torch.arange(expert.shape[0], device=x.device) - (counts.cumsum(0) - counts).index_select(0, sorted_expert)
    block = x.new_zeros(num, capacity, x.shape[1])
    block[sorted_expert, slot] = x.index_select(0, order)
    out = torch.bmm(block, weight.transpose(1, 2))[sorted_expert, slot]
    return torch.empty_like(out).index_copy_(0, order, out)
