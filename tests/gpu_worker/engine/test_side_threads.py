"""Threads beside the engine's start no OpenMP team of their own (``engine/side_threads.py``): one
large torch op on an unconfined thread leaves the process managing more OpenMP threads than it
has cores, and libgomp then stops spinning for the engine's team too (batch-1 decode halved on
a 2-core machine). The process's OS threads are counted: a new team is new threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from services.gpu_worker.engine.adapter_copier import AdapterCopier
from services.gpu_worker.engine.side_threads import BACKGROUND_NICE, confine_to_one_thread

LARGE = 4 * 2**20
"""Elements: far above torch's grain size (32,768), so an unconfined copy runs in parallel."""


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def large_copy() -> int:
    source = torch.randn(LARGE)
    torch.empty_like(source).copy_(source)
    return torch.get_num_threads()


def test_a_confined_thread_runs_torch_serially_and_the_others_keep_their_threads():
    seen: list[int] = []
    before = torch.get_num_threads()

    def confined() -> None:
        confine_to_one_thread()
        seen.append(large_copy())

    thread = threading.Thread(target=confined)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == before  # this thread's setting is untouched


def test_the_page_in_thread_starts_no_openmp_team():
    copier = AdapterCopier(lambda adapter, resident: None, torch.device("cpu"))
    try:
        copier._thread.submit(lambda: None).result()  # the thread exists before counting
        before = os_threads()
        assert copier._thread.submit(large_copy).result() == 1
        assert os_threads() <= before  # none started (another test's thread may end meanwhile)
        native_id = copier._thread.submit(threading.get_native_id).result()
        assert os.getpriority(os.PRIO_PROCESS, native_id) == BACKGROUND_NICE  # it gives way to the steps
    finally:
        copier.close()


def test_a_confined_thread_starts_no_team_through_mkl_either():
    """MKL's vector math (float64 ``cos``: the rotary tables) keeps its own thread count, which
    ``torch.set_num_threads`` sets for the whole process, as the worker's ``--threads`` does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ThreadPoolExecutor(1, initializer=confine_to_one_thread) as side:
            side.submit(lambda: None).result()
            before = os_threads()
            side.submit(lambda: torch.arange(LARGE, dtype=torch.float64).cos()).result()
            assert os_threads() <= before  # none started (another test's thread may end meanwhile)
    finally:
        torch.set_num_threads(threads)
