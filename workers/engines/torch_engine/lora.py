"""LoRA adapters in PEFT's format on the torch engine's linear layers, any number of them in one batch.

Every projection of the decoder (q/k/v/o, gate/up/down) is a `LoraLinear`: a `nn.Linear` (so weights load under
Hugging Face's names) that also holds, per loaded adapter, its low-rank pair A [r × in], B [out × r] and its
scale (`lora_alpha / r`, or `/ √r` with rsLoRA). A step's tokens are grouped by adapter (`LoraBatch`); each group
gets `x·Aᵀ·Bᵀ·scale` added to the base output, so requests on different adapters and on the base model share
one forward. With no adapter in a step the layers cost what `nn.Linear` costs.

What PEFT can save and this does not apply is refused when loading, naming the option: DoRA, trained biases,
`modules_to_save`, `fan_in_fan_out`, per-module alphas, and adapters on layers other than the decoder's
projections (embeddings, lm_head).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Token indices of a step per adapter name: the tokens of every sequence that runs with that adapter.
LoraBatch = tuple[tuple[str, torch.Tensor], ...]

# Module paths inside `CausalLM` that take adapters, as PEFT names them (after `base_model.model.`).
_TARGET = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)$")
_TENSOR_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights",
                "modules_to_save": "modules_to_save (fully trained extra layers)", "alpha_pattern": "alpha_pattern"}


@dataclass(frozen=True, slots=True)
class LoraWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float


class LoraLinear(nn.Linear):
    """`nn.Linear` plus the low-rank updates of the adapters loaded on it, applied per token group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.adapters: dict[str, LoraWeights] = {}

    def forward(self, x: torch.Tensor, lora: LoraBatch = ()) -> torch.Tensor:
        y = super().forward(x)
        for name, rows in lora:
            weights = self.adapters.get(name)
            if weights is None:
                continue  # this adapter leaves this layer as it is
            delta = (x.index_select(0, rows) @ weights.a.T) @ weights.b.T
            y.index_add_(0, rows, delta, alpha=weights.scale)
        return y


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter read from disk, checked against the model, not yet installed."""

    path: Path
    rank: int
    weights: dict[str, LoraWeights]  # module path -> its pair


def read_peft_adapter(path: Path, model: nn.Module, dtype: torch.dtype, device: torch.device) -> PeftAdapter:
    """Read `adapter_config.json` and `adapter_model.safetensors` (or `.bin`); ValueError names what does not fit."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a PEFT adapter: it has no adapter_config.json")
    config = json.loads(config_file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = [label for key, label in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']!r}")
    if refused:
        raise ValueError(f"{path}: the torch engine does not apply {', '.join(refused)}")
    alpha, use_rslora = float(config.get("lora_alpha", config.get("r", 8))), bool(config.get("use_rslora", False))
    pairs = _read_pairs(_read_tensors(path))
    weights: dict[str, LoraWeights] = {}
    for module_path, (a, b) in pairs.items():
        layer = _target_layer(model, module_path, path)
        rank = a.shape[0]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise ValueError(f"{path}: {module_path} has A {list(a.shape)} and B {list(b.shape)}; the model's layer "
                             f"is {layer.in_features} -> {layer.out_features}")
        scale = alpha / (math.sqrt(rank) if use_rslora else rank)
        weights[module_path] = LoraWeights(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), scale)
    return PeftAdapter(path, max(w.a.shape[0] for w in weights.values()), weights)


def install(model: nn.Module, name: str, adapter: PeftAdapter) -> None:
    for module_path, weights in adapter.weights.items():
        layer = model.get_submodule(module_path)
        assert isinstance(layer, LoraLinear)
        layer.adapters[name] = weights


def uninstall(model: nn.Module, name: str) -> None:
    for layer in model.modules():
        if isinstance(layer, LoraLinear):
            layer.adapters.pop(name, None)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise ValueError(f"{path} has no adapter_model.safetensors or adapter_model.bin")


def _read_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_KEY.match(key)
        if match is None:
            raise ValueError(f"tensor {key!r} is not a LoRA A or B weight (only those are applied)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    incomplete = [module for module, pair in parts.items() if set(pair) != {"A", "B"}]
    if incomplete or not parts:
        raise ValueError(f"an adapter needs an A and a B weight per layer; {incomplete[:3] or 'no layers'} lack one")
    return {module: (pair["A"], pair["B"]) for module, pair in parts.items()}


def _target_layer(model: nn.Module, module_path: str, path: Path) -> LoraLinear:
    if _TARGET.match(module_path) is None:
        raise ValueError(f"{path}: an adapter on {module_path} is not applied here (only the decoder's attention and "
                         f"MLP projections take adapters)")
    try:
        layer = model.get_submodule(module_path)
    except AttributeError:
        raise ValueError(f"{path}: the model has no layer {module_path}") from None
    assert isinstance(layer, LoraLinear)
    return layer
