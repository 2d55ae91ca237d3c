"""``python -m services.model_files.template_worker BUDGET_JSON``: render chat templates sent on
stdin, one at a time, until stdin ends (:class:`.template_process.TemplateProcess` starts it).

Each render is held to the budget's operations and output by its meter, and to its CPU time
twice over: a profiling timer raises in the render when its CPU seconds are spent, and, should
the render be stuck where Python cannot raise (inside one long C call), the kernel's CPU limit
kills the process a second or two later (``SIGXCPU``); its parent then starts another. Its
memory is capped once, at start: what it maps then plus the budget's MiB. It runs at the lowest CPU
priority there is (:func:`_lowest_cpu_priority`). It imports Jinja and the budget alone, so it
starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import sys
from collections.abc import Iterator
from typing import Any

from services.model_files.chat_template import ChatTemplateError, TemplateOverBudget, render_chat_template
from services.model_files.template_budget import BudgetExhausted, TemplateBudget
from services.model_files.template_process import read_frame, write_frame

RENDER_NICENESS = 19
"""Added to the render process's niceness: the most there is."""


def main() -> None:
    budget = TemplateBudget(**json.loads(sys.argv[1]))
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the reply stream
    _lowest_cpu_priority()
    _cap_memory(budget.chat_template_memory_mib)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump a core by default
    signal.signal(signal.SIGPROF, _cpu_spent(budget.chat_template_cpu_s))
    while (request := read_frame(requests)) is not None:
        write_frame(replies, _answer(request, budget))


def _lowest_cpu_priority() -> None:
    """A render takes only what serving leaves. One tenant's renders that use their whole budget,
    one after another, kept a core busy and made a worker's threads on the same host wait for each
    other (docs/benchmarks.md, "Template isolation").

    Niceness alone is not enough: with the kernel's autogroups (a scheduling group per session,
    the default on desktop and VM kernels), niceness ranks a process only against its own session,
    and ``loramesh up`` starts each service in a session of its own, so the CPU was split evenly
    between the gateway's session, renders included, and the worker's. So the render process
    leaves the gateway's session for one of its own and lowers that group's priority as far as it
    goes; in a container's cgroup (no autogroup) the niceness does that work. It also runs under
    ``SCHED_IDLE``: a core running only such a task counts as idle, so a serving thread that wakes
    is put there and runs at once (p90 of the other tenant's latency 1.26x of alone, against 1.43x
    at niceness alone). Each step is skipped where the platform lacks it."""
    os.setsid()
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as autogroup:
        autogroup.write(str(RENDER_NICENESS))
    os.nice(RENDER_NICENESS)
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: a platform without it
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _answer(request: dict[str, Any], budget: TemplateBudget) -> dict[str, Any]:
    try:
        with _cpu_limited(budget.chat_template_cpu_s):
            return {"text": render_chat_template(request["template"], budget, **request["variables"])}
    except TemplateOverBudget as over:
        return {"over_budget": over.message, "setting": over.setting}
    except BudgetExhausted as over:  # the timer fired after the render, before it was stopped
        return {"over_budget": over.message, "setting": over.setting}
    except ChatTemplateError as error:
        return {"refused": str(error)}


def _cpu_spent(cpu_s: float):
    def handler(signum, frame):
        raise BudgetExhausted(f"more than {cpu_s} CPU seconds", "chat_template_cpu_s")

    return handler


@contextlib.contextmanager
def _cpu_limited(cpu_s: float) -> Iterator[None]:
    """The body may use ``cpu_s`` of CPU: then the profiling timer raises in it, and about two
    seconds of CPU later (the kernel's limit counts whole seconds) the kernel kills the process."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(spent + cpu_s) + 1
    resource.setrlimit(
        resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


def _cap_memory(mib: int) -> None:
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + mib * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(
        resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
    )


if __name__ == "__main__":
    main()
