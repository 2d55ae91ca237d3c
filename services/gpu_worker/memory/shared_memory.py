"""Tensors in anonymous shared memory (a Linux memfd), so that another process on the same host can
map the same bytes: a creditor's unified pool, which same-host debtors attend over in place (the
shared-memory lending lane, ``lending_lane.py``).

A memfd has no name in any directory: a process gets it only as a file descriptor passed over a
Unix socket (``SCM_RIGHTS``), and its memory goes when the last mapping and descriptor close, so
a killed worker leaves nothing behind. Pages are allocated on first touch, as ``torch.zeros``'s
are for a large buffer.
"""

from __future__ import annotations

import os

import torch


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shared_zeros(numel: int, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, int]:
    """A zero-filled 1-D tensor of ``numel`` elements in a new memfd, and the memfd (owned by the
    caller: it stays open as long as the tensor may be shared)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(1, numel * _element_size(dtype)))
        return map_shared(fd, numel, dtype), fd
    except BaseException:
        os.close(fd)
        raise


def map_shared(fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of the memory behind ``fd``, mapped shared (writes are seen by
    every process that maps it). Refused when the memory is smaller."""
    size = os.fstat(fd).st_size
    if size < numel * _element_size(dtype):
        raise ValueError(f"shared memory of {size} bytes cannot hold {numel} {dtype} elements")
    # Opened by its /proc path: from_file maps a path, and this one is the descriptor's own file.
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
