"""Host tensors in memory the kernel may back with 2 MiB pages (transparent huge pages).

Why: decode at small batches streams every base weight once per token, and with 4 KiB pages the
~20,000 pages of a 4-bit 135M model miss the TLB as they stream. Gathered into one region advised
``MADV_HUGEPAGE``, the same step ran 4–5% faster on the 2-core development machine (batch 1,
``q4_1``, alternated in one process; bench/HISTORY.md). Where transparent huge pages are off
(``/sys/kernel/mm/transparent_hugepage/enabled`` = never) the advice is ignored and the tensors
are ordinary ones.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
"""x86-64's transparent huge page size: a region advised for huge pages starts on this boundary."""
ALIGNMENT = 64
"""Each gathered tensor starts on a cache line (the native kernels' vector loads)."""


@functools.cache
def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back ``[address, address + nbytes)`` (page-aligned ``address``) with huge
    pages as it is first touched; False where the kernel refuses (or has no such advice)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return False
    return _madvise()(address, nbytes, advice) == 0


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` bytes that starts on a huge page and is
    advised for huge pages before any of it is touched."""
    # Untouched until written: a large torch.empty is a fresh anonymous mapping.
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    region = buffer[start : start + nbytes]
    advise_huge_pages(region.data_ptr(), nbytes)
    return region


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def gather_in_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of the CPU ``tensors`` (same dtypes and shapes), side by side in one
    huge-page region, each on a cache line."""
    buffer = huge_page_bytes(sum(_aligned(t.numel() * t.element_size()) for t in tensors))
    copies, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        copy = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
        offset += _aligned(nbytes)
    return copies
