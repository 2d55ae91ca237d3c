"""Which dtype the model computes in, given the dtype its weights are stored in.

Weights, the KV cache and adapter pages are stored in the model's dtype (bf16 halves their
memory). The arithmetic need not follow: a CPU without bf16 (or fp16) matrix units, such as an
AVX2-only or plain AVX-512 machine, runs a bf16 GEMM through oneDNN's emulation at about a fifth
of its fp32 rate (measured on an AVX2 EPYC: ≈20 GFLOP/s bf16 against 70-100 fp32, so HF
``generate`` decodes 3× faster in fp32 than in bf16 there). On such a CPU the model widens each
stored weight to fp32 right before its matmul (see ``base_matmul``) and keeps activations in
fp32; where the hardware has the units (CUDA, avx512_bf16/AMX, avx512_fp16) it computes in the
storage dtype.
"""

from __future__ import annotations

import torch


def cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU runs ``dtype`` (bf16 or fp16) GEMMs natively."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def resolve_compute_dtype(storage: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype of activations and matmuls for weights stored in ``storage`` on ``device``:
    ``storage`` itself on accelerators and on CPUs with native half-precision GEMMs, float32 on
    CPUs that would emulate them."""
    if storage == torch.float32 or torch.device(device).type != "cpu":
        return storage
    return storage if cpu_has_half_gemm(storage) else torch.float32
