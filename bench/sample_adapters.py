"""Write synthetic LoRA adapters in exactly the form PEFT's ``save_pretrained`` produces.

Tests and the benchmarks need many adapters of chosen ranks, targets and dtypes without
training any. The files have the layout PEFT saves for a ``LlamaForCausalLM`` LoRA
(``adapter_config.json`` with PEFT's field names and defaults, ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`` tensors, A of
shape ``(r, in_features)`` and B ``(out_features, r)``), so real PEFT loads them and the adapter
store validates them like any upload. Weights are random (B too, unlike PEFT's zero init, so an
adapter visibly changes the model's output) and deterministic given the seed.

:func:`read_peft_directory` reads one back as the worker holds it (a ``HostAdapter``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.model_files.base_model import BaseModelSpec
from services.model_files.peft_format import LORA_TARGETS, module_path, pattern_value, tensor_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DTYPES = ("float16", "float32", "bfloat16")


@dataclass(frozen=True)
class SampleAdapterSpec:
    """What adapter to write."""

    rank: int = 8
    """``r``: the rank of every module ``rank_pattern`` does not override."""
    lora_alpha: float = 16.0
    """``lora_alpha``: the scaling numerator of every module ``alpha_pattern`` does not override."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Projections adapted in every layer, a subset of LORA_TARGETS."""
    dtype: str = "float16"
    """``"float16"``, ``"float32"`` or ``"bfloat16"``."""
    use_rslora: bool = False
    """Scale by ``alpha / sqrt(r)`` instead of ``alpha / r``."""
    rank_pattern: dict | None = None
    """Per-module ranks with PEFT semantics: key (a regex) -> rank; the first key matching wins."""
    alpha_pattern: dict | None = None
    """Per-module alphas with PEFT semantics, like ``rank_pattern``."""
    seed: int = 0
    """Seed of the random weights: the same spec always writes the same bytes."""
    scale: float = 0.02
    """Standard deviation of the random weights of both A and B."""


def write_peft_adapter(
    directory: str | Path,
    spec: BaseModelSpec,
    sample: SampleAdapterSpec,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``directory``.

    Every layer of ``spec`` gets the targeted projections. Returns the directory.
    """
    unknown = sorted(set(sample.target_modules) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"target_modules {unknown} are not among {LORA_TARGETS}")
    if sample.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {sample.dtype!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(
        json.dumps(_peft_config(sample, base_model_name_or_path), indent=2, sort_keys=True) + "\n"
    )
    _save(_weights(spec, sample), directory / WEIGHTS_FILE, sample.dtype)
    return directory


def adapter_files(directory: str | Path) -> dict[str, bytes]:
    """The two files of an adapter directory, by file name, as an upload sends them."""
    directory = Path(directory)
    return {name: (directory / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def _peft_config(sample: SampleAdapterSpec, base_model_name_or_path: str | None) -> dict:
    """The fields ``LoraConfig.save_pretrained`` writes, with PEFT's defaults for the rest."""
    return {
        "alpha_pattern": dict(sample.alpha_pattern or {}),
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": sample.lora_alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": sample.rank,
        "rank_pattern": dict(sample.rank_pattern or {}),
        "revision": None,
        "target_modules": sorted(sample.target_modules),
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_dora": False,
        "use_rslora": sample.use_rslora,
    }


def _weights(spec: BaseModelSpec, sample: SampleAdapterSpec) -> dict[str, np.ndarray]:
    """Random float32 A and B for every targeted projection of every layer, in a fixed order."""
    rng = np.random.default_rng(sample.seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in LORA_TARGETS:
            if module not in sample.target_modules:
                continue
            rank = pattern_value(sample.rank_pattern, module_path(layer, module), sample.rank)
            in_features, out_features = spec.projection_shape(module)
            for factor, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
                weight = rng.standard_normal(shape, dtype=np.float32) * np.float32(sample.scale)
                tensors[tensor_name(layer, module, factor)] = weight
    return tensors


def _save(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Save like PEFT (metadata ``{"format": "pt"}``), converting float32 to ``dtype``."""
    metadata = {"format": "pt"}
    if dtype == "bfloat16":  # numpy has no bfloat16
        from safetensors.torch import save_file as save_torch

        bf16 = {name: torch.from_numpy(t).to(torch.bfloat16) for name, t in tensors.items()}
        save_torch(bf16, str(path), metadata=metadata)
    else:
        save_file({name: t.astype(dtype) for name, t in tensors.items()}, str(path), metadata=metadata)


def read_peft_directory(adapter_id: str, directory: str | Path, dtype: torch.dtype) -> HostAdapter:
    """Parse the PEFT adapter saved in ``directory`` (``save_pretrained`` output)."""
    directory = Path(directory)
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    return parse_peft_adapter(adapter_id, config, weights, dtype)
