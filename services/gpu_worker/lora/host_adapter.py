"""A PEFT LoRA adapter parsed into per-(layer, projection) factors, ready to page in.

The adapter arrives as the bytes the adapter store serves (validated there); here it becomes
``A`` (r × in) and ``Bᵀ`` (r × out) per targeted projection, with its scale:
``lora_alpha / r`` or, with ``use_rslora``, ``lora_alpha / sqrt(r)`` — where ``r`` and
``lora_alpha`` follow PEFT's ``rank_pattern``/``alpha_pattern`` for that module.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from services.model_files.peft_format import module_path, parse_tensor_name, pattern_value
from services.runtime.errors import InvalidArgument

ModuleKey = tuple[int, str]


@dataclass(frozen=True)
class LoraFactors:
    """One projection's LoRA: ``delta(x) = scale * (x @ a.T) @ b_t``."""

    a: torch.Tensor
    """``(r, in_features)``."""
    b_t: torch.Tensor
    """``(r, out_features)``: PEFT's B transposed, so each rank is one contiguous row."""
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class HostAdapter:
    """An adapter in host memory."""

    adapter_id: str
    modules: dict[ModuleKey, LoraFactors]
    """``(layer, projection name) -> factors`` for every targeted projection."""
    content_sha256: str = ""
    """sha256 of the bytes it was parsed from (config and weights): names this version of the
    adapter in the prefix cache's keys. Empty: unknown (built in memory), and its requests
    bypass the prefix cache."""

    @property
    def nbytes(self) -> int:
        return sum(f.a.nbytes + f.b_t.nbytes for f in self.modules.values())

    @property
    def max_rank(self) -> int:
        return max((f.rank for f in self.modules.values()), default=0)


def parse_peft_adapter(
    adapter_id: str, config_json: bytes | str, weights: bytes, dtype: torch.dtype
) -> HostAdapter:
    """Build a :class:`HostAdapter` from ``adapter_config.json`` and safetensors bytes."""
    config = json.loads(config_json)
    r, alpha = config["r"], config["lora_alpha"]
    rslora = bool(config.get("use_rslora", False))
    tensors = load_safetensors(bytes(weights))
    pairs: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise InvalidArgument(f"adapter {adapter_id}: unexpected tensor {name!r}")
        layer, module, factor = parsed
        pairs.setdefault((layer, module), {})[factor] = tensor
    modules = {}
    for (layer, module), factors in sorted(pairs.items()):
        path = module_path(layer, module)
        rank = pattern_value(config.get("rank_pattern"), path, r)
        module_alpha = pattern_value(config.get("alpha_pattern"), path, alpha)
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        modules[(layer, module)] = LoraFactors(
            a=factors["A"].to(dtype).contiguous(),
            b_t=factors["B"].t().to(dtype).contiguous(),
            scale=float(scale),
        )
    return HostAdapter(
        adapter_id=adapter_id, modules=modules, content_sha256=content_sha256(config_json, weights)
    )


def content_sha256(config_json: bytes | str, weights: bytes) -> str:
    """sha256 of an adapter's config and weights, each length-prefixed (so no two different
    pairs hash alike by moving bytes across the boundary)."""
    config = config_json.encode() if isinstance(config_json, str) else bytes(config_json)
    digest = hashlib.sha256()
    for part in (config, bytes(weights)):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def read_peft_directory(adapter_id: str, directory: str | Path, dtype: torch.dtype) -> HostAdapter:
    """Parse the PEFT adapter saved in ``directory`` (``save_pretrained`` output)."""
    directory = Path(directory)
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    return parse_peft_adapter(adapter_id, config, weights, dtype)
