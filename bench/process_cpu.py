"""CPU time of a local mesh's processes and of their named threads, from ``/proc``: what a phase
of a bench cost each service in CPU, which a shared machine's load does not inflate as it does
wall time (a process waiting for a core accrues none)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
"""The kernel's unit of CPU time in ``/proc/<pid>/stat`` (10 ms on Linux's usual 100 Hz)."""


def _stat_cpu_s(path: Path) -> tuple[str, int, float]:
    """A ``stat`` file's command name, nice value and user + system CPU seconds (0 when it is
    gone)."""
    try:
        text = path.read_text()
    except OSError:
        return "", 0, 0.0
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return name, int(fields[16]), (int(fields[11]) + int(fields[12])) * TICK_S


def thread_kind(name: str, nice: int, main: bool) -> str:
    """What a thread is as far as ``/proc`` tells (Python 3.11 names no thread of its own): the
    process's first thread (``main``: a service's event loop), a named native thread (gRPC's
    ``event_engine``...), pool indices dropped so a pool's threads add up, and its nice value
    when lowered (the workers' page-in and background-parse threads run at nice 10)."""
    kind = "main" if main else re.sub(r"[-_]?\d+(_\d+)?$", "", name) or name
    return f"{kind}@nice{nice}" if nice else kind


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``: every state but idle and
    iowait), every process's, others' included."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) * TICK_S


MACHINE = "machine"
"""The entry of :func:`snapshot` holding the whole machine's busy CPU."""


def snapshot(pids: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Per service, CPU seconds so far: ``"total"`` (the process, its ended threads included)
    and each thread kind's, of the threads alive now; and :data:`MACHINE`'s."""
    taken: dict[str, dict[str, float]] = {MACHINE: {"total": machine_busy_s()}}
    for service, pid in pids.items():
        total = _stat_cpu_s(Path(f"/proc/{pid}/stat"))[2]
        threads: dict[str, float] = {"total": total}
        for task in Path(f"/proc/{pid}/task").glob("*"):
            name, nice, seconds = _stat_cpu_s(task / "stat")
            if name:
                kind = thread_kind(name, nice, task.name == str(pid))
                threads[kind] = threads.get(kind, 0.0) + seconds
        taken[service] = threads
    return taken


def spent_ms(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    per: int = 1,
    least_ms: float = 1.0,
) -> dict[str, dict[str, float]]:
    """CPU ms each service (and thread kind) spent from ``before`` to ``after``, divided by
    ``per``; thread kinds under ``least_ms`` left out. A thread that started in between counts
    whole: threads a phase starts are its work."""
    spent: dict[str, dict[str, float]] = {}
    for service, threads in after.items():
        old = before.get(service, {})
        per_thread = {k: 1000 * (v - old.get(k, 0.0)) / per for k, v in threads.items()}
        spent[service] = {
            k: round(v, 1)
            for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1])
            if k == "total" or v >= least_ms
        }
    return spent
