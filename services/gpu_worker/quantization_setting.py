"""The ``--quantization`` setting of a worker and what ``auto`` means on each device (no torch
here: the CLI imports it to list the choices)."""

from __future__ import annotations

QUANTIZATIONS = ("none", "q8_0", "q4_1")
"""The base-weight formats (``model/quantization.py``)."""
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)
"""The values of ``--quantization``."""
AUTO_ON_CPU = "q4_1"
"""What ``auto`` picks on a CPU worker: the format that served fastest there (docs/benchmarks.md,
"Quantized base")."""


def resolve_quantization(setting: str, device_type: str, tp: int = 1) -> str:
    """The format a worker on ``device_type`` runs for ``setting``; ValueError naming the flag
    when the setting cannot run there (the quantized kernels are CPU-only and unsharded)."""
    if setting not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization {setting!r}: choose from {', '.join(QUANTIZATION_CHOICES)}")
    if setting == "auto":
        return AUTO_ON_CPU if device_type == "cpu" and tp == 1 else "none"
    if setting != "none" and (device_type != "cpu" or tp > 1):
        raise ValueError(
            f"--quantization {setting} runs on a CPU worker without tensor parallelism "
            f"(this one: {device_type}, --tp {tp}); use --quantization none or auto"
        )
    return setting
