"""The LoRA kernel backends this test process can run (what the dispatch point picks from)."""

from __future__ import annotations

import importlib.util

import torch

from services.gpu_worker.kernels.cpu_native import native_available


def available_backends() -> tuple[str, ...]:
    """Backends that can run in this process: ``torch`` and ``padded_bmm`` always, ``cpu_native``
    when the C kernel compiled, ``triton`` with CUDA or with the Triton interpreter
    (``TRITON_INTERPRET=1``) on."""
    found = ["torch", "padded_bmm"]
    if native_available():
        found.append("cpu_native")
    if importlib.util.find_spec("triton") is not None:
        from triton import knobs

        if torch.cuda.is_available() or knobs.runtime.interpret:
            found.append("triton")
    return tuple(found)
