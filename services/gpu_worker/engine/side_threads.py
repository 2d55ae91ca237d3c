"""Threads beside the engine's run torch on one thread, so that only the engine's thread ever
starts an OpenMP team.

Why: torch (and the native kernels, which share its libgomp) run parallel work on the calling
thread's own OpenMP team. A second thread that runs one large torch op (an adapter page-in's
copy, a loader's dtype conversion) gets a team of its own, and from then on the process manages
more OpenMP threads than the machine has cores, so libgomp stops spinning between parallel
regions everywhere: batch-1 decode on the 2-core development machine fell from 113–125 to 58–66
tokens/s after one 5M-element copy on a side thread, and stayed there (docs/benchmarks.md,
"Batch 1 against llama-server"). Confined side threads run their ops serially: they are copies
and bookkeeping, never the step.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.cache
def _omp_set_num_threads():
    """libgomp's ``omp_set_num_threads``, from the copy torch loaded (None: torch has no OpenMP)."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads  # the loaded one: same soname
    except (OSError, AttributeError):
        return None


def confine_to_one_thread() -> None:
    """This thread's torch ops run serially from now on (other threads keep their settings)."""
    torch.get_num_threads()  # torch's per-thread set-up first, so that it cannot undo the next line
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def side_thread_pool(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are confined to one torch thread."""
    return ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=confine_to_one_thread
    )
