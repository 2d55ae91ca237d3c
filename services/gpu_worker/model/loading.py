"""The one way the worker gets its base model: weights, config and tokenizer from a path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader

from services.gpu_worker.model import gguf_loader
from services.gpu_worker.model.hf_loader import load_hf_dir
from services.gpu_worker.model.quantization import quantize_weights
from services.gpu_worker.model.quantized_weight import QuantizedWeight
from services.model_files.base_model import default_model_path
from services.model_files.model_config import ModelConfig
from services.model_files.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A base model ready to be put on a device."""

    config: ModelConfig
    """Its hyperparameters."""
    weights: dict[str, torch.Tensor | QuantizedWeight]
    """HF-named tensors (``model.layers.0.self_attn.q_proj.weight``...); no ``lm_head.weight`` when
    tied. With a quantization, the weights it quantizes are :class:`QuantizedWeight` blocks."""
    tokenizer: Tokenizer
    """Its tokenizer and chat template."""
    source: str
    """What was read: the HF directory, the GGUF file, or the GGUF's converted cache file."""
    quantization: str = "none"
    """The base weights' block format (``model/quantization.py``)."""


def load_model(
    path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
) -> LoadedModel:
    """Load a HF model directory or a GGUF file (``None``: the default SmolLM2-135M-Instruct GGUF).

    A GGUF's conversion is cached in ``cache_dir`` (default
    :func:`gguf_loader.default_cache_dir`) and reused while the file keeps its size and mtime.
    ``quantization`` (``model/quantization.py``) keeps the projections in a GGUF block format,
    from the file's own blocks where it holds them in that format.
    """
    loaded = _load_unquantized(path, cache_dir, dtype)
    if quantization == "none":
        return loaded
    model_path = Path(path) if path is not None else default_model_path()
    from_file = {}
    if model_path.suffix == ".gguf":
        blocks_dir = Path(cache_dir) if cache_dir is not None else None
        from_file = gguf_loader.cached_quantized_tensors(model_path, loaded.config, blocks_dir)
    weights = quantize_weights(loaded.weights, quantization, from_file)
    return LoadedModel(loaded.config, weights, loaded.tokenizer, loaded.source, quantization)


def _load_unquantized(
    path: str | Path | None, cache_dir: str | Path | None, dtype: torch.dtype
) -> LoadedModel:
    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        config, weights = load_hf_dir(path, dtype)
        tokenizer = Tokenizer.from_hf_dir(path, extra_eos_token_ids=config.eos_token_ids)
        return LoadedModel(config, weights, tokenizer, str(path))
    if not path.is_file():
        raise FileNotFoundError(f"no model at {path}")
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a .gguf file nor a HF model directory")
    cached = gguf_loader.cache_path(path, Path(cache_dir) if cache_dir is not None else None)
    hit = gguf_loader.read_cached(cached)
    if hit is not None:
        config, weights, tokenizer = hit
        source = str(cached)
    else:
        reader = GGUFReader(str(path))
        config = ModelConfig.from_gguf(reader)
        weights = gguf_loader.convert_weights(reader, config)
        tokenizer = Tokenizer.from_gguf(reader)
        gguf_loader.write_cached(cached, config, weights, tokenizer)
        source = str(path)
    if dtype != torch.float32:
        weights = {name: w.to(dtype) for name, w in weights.items()}
    return LoadedModel(config, weights, tokenizer, source)
