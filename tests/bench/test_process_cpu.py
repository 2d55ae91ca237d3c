"""The bench's CPU accounting of a mesh's processes reads this process's own threads right."""

from __future__ import annotations

import os
import threading
import time

from bench.process_cpu import MACHINE, snapshot, spent_ms, thread_kind


def test_thread_kinds_group_a_pools_threads_and_mark_the_main_thread_and_lowered_ones():
    assert thread_kind("ThreadPoolExecutor-0_1", 0, False) == "ThreadPoolExecutor"
    assert thread_kind("event_engine", 0, False) == "event_engine"
    assert thread_kind("python", 0, True) == "main"
    assert thread_kind("python", 10, False) == "python@nice10"


def test_the_cpu_a_busy_thread_spends_is_counted_to_its_process():
    pids = {"me": os.getpid()}
    before = snapshot(pids)
    done = threading.Event()

    def busy() -> None:
        until = time.thread_time() + 0.2  # CPU time, whatever the machine's load
        while time.thread_time() < until:
            pass
        done.set()

    thread = threading.Thread(target=busy)
    thread.start()
    thread.join()
    spent = spent_ms(before, snapshot(pids), per=2)
    assert done.is_set() and spent["me"]["total"] >= 0.2 * 1000 / 2 - 20  # one clock tick of slack each
    assert spent[MACHINE]["total"] >= spent["me"]["total"] - 20
