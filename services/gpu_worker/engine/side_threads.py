"""Threads beside the engine's run torch on one thread, so that only the engine's thread ever
starts an OpenMP team.

Why: torch (and the native kernels, which share its libgomp) run parallel work on the calling
thread's own OpenMP team. A second thread that runs one large torch op (an adapter page-in's
copy, a loader's dtype conversion) gets a team of its own, and from then on the process manages
more OpenMP threads than the machine has cores, so libgomp stops spinning between parallel
regions everywhere: batch-1 decode on the 2-core development machine fell from 111–113 to 54–58
tokens/s after one 5M-element copy on a side thread, and stayed there (bench/HISTORY.md,
"Batch 1 against llama-server"). Confined side threads run their ops serially: they are copies
and bookkeeping, never the step.

MKL, linked into torch, counts its threads apart from OpenMP's per-thread setting and starts a
team through the same libgomp: the rotary tables' ``torch.cos`` (MKL's vector math) on the
loader's thread made a team there, and ``loramesh up``'s served batch-1 decode ran at half the
in-process rate. So confining also sets MKL's thread-local count.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.cache
def _omp_set_num_threads():
    """libgomp's ``omp_set_num_threads``, from the copy torch loaded (None: torch has no OpenMP)."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads  # the loaded one: same soname
    except (OSError, AttributeError):
        return None


@functools.cache
def _mkl_set_num_threads_local():
    """MKL's C ``MKL_Set_Num_Threads_Local``, exported by torch's CPU library (None: no MKL
    there). The lower-case names are Fortran's: they take a pointer."""
    try:
        return ctypes.CDLL("libtorch_cpu.so").MKL_Set_Num_Threads_Local  # the loaded one, by soname
    except (OSError, AttributeError):
        return None


def confine_to_one_thread() -> None:
    """This thread's torch ops run serially from now on (other threads keep their settings)."""
    torch.get_num_threads()  # torch's per-thread set-up first, so that it cannot undo the next lines
    for set_threads in (_omp_set_num_threads(), _mkl_set_num_threads_local()):
        if set_threads is not None:
            set_threads(1)


BACKGROUND_NICE = 10
"""Nice value of background side threads: a tenth of a normal thread's CPU share when they
compete. Measured with ``bench.adapter_page_in_bench`` (2 cores, 20 adapters paging in beside a
batch of 8, one run each): nice 0 slowed the batch's steps by 19.5%, 5, 10 and 12 by 10.7%,
15.3% and 10.9%, 19 by 3.5% but left 13–17 of the 20 copies unfinished after 30 steps (starved
by the engine's spinning team)."""


def run_in_background() -> None:
    """This thread gives way to the engine's when both want a core, and still uses idle ones."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def _confine_in_background() -> None:
    confine_to_one_thread()
    run_in_background()


def side_thread_pool(
    max_workers: int, thread_name_prefix: str, background: bool = False
) -> ThreadPoolExecutor:
    """A thread pool whose threads are confined to one torch thread; ``background``: and run at
    :data:`BACKGROUND_NICE` (work that must not slow the steps down, such as adapter page-in)."""
    return ThreadPoolExecutor(
        max_workers=max_workers,
        thread_name_prefix=thread_name_prefix,
        initializer=_confine_in_background if background else confine_to_one_thread,
    )
