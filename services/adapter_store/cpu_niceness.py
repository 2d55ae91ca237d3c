"""The store's CPU priority below the services that decode, where they share cores.

A publish of new content costs the store ~25 ms of CPU (the upload's receive, its sha256, the
validation, the blob's durable write), at a training loop's 10 publishes a second a quarter of a
core; on a host where the workers decode on the CPU, that comes out of their tokens. Niceness
alone does not move it: under the kernel's autogroups (a scheduling group per session, the
default on desktop and VM kernels) a process's niceness ranks it only within its own session, and
``loramesh up`` starts each service in a session of its own, so the CPU is split between the
sessions first. So the store lowers its session's group too (``/proc/self/autogroup``), when it
leads that session: a store started from a shell leaves the shell's group alone. In a
container's cgroup (no autogroups) the threads' niceness is what counts. Raising niceness needs
no privilege; each step is skipped where the platform lacks it.
"""

from __future__ import annotations

import contextlib
import os
import time

AUTOGROUP = "/proc/self/autogroup"
AUTOGROUP_TRIES = 20
"""The kernel takes one unprivileged autogroup change every 100 ms, machine-wide (EAGAIN between):
replicas starting together each get their turn within two seconds."""
AUTOGROUP_RETRY_S = 0.1


def lower_cpu_priority(niceness: int, sleep=time.sleep) -> None:
    """Every thread of this process at ``niceness`` (threads started later inherit it), and this
    session's autogroup too when this process leads the session. 0 changes nothing."""
    if niceness <= 0:
        return
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            tid = int(task)
            os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
    if os.getsid(0) != os.getpid():
        return
    for _ in range(AUTOGROUP_TRIES):
        try:
            with open(AUTOGROUP, "w") as autogroup:
                autogroup.write(str(niceness))
            return
        except BlockingIOError:
            sleep(AUTOGROUP_RETRY_S)
        except OSError:  # no autogroups here (a kernel without them, a read-only /proc)
            return
