"""How much load the engine takes here, measured before the sweeps so each offered load is a
share of what this machine (and its neighbours' load at the time) actually serves.

Capacity: a closed backlog — every request queued at time 0 — served by the FCFS engine;
completed requests over the time to the last completion. Low-load first-token latency: the
median over a Poisson trace at a small share of that capacity (S-LoRA's SLO is a multiple of it).
"""

from __future__ import annotations

import statistics

from bench.policies.harness import RunSetting, run_trace
from bench.policies.traces import backlog_trace
from bench.systems.base import RequestRecord
from bench.systems.engine_system import EngineSystem, EngineSystemOptions

DTYPE = "float32"
"""Every engine of the suite computes in fp32 (the merged-only baseline does too)."""


def backlog_throughput(records: list[RequestRecord]) -> float:
    """Completed requests per second of a backlog that all arrived at 0."""
    done = [r.finish_s for r in records if r.completed]
    if not done:
        raise RuntimeError("the capacity backlog completed no request")
    return len(done) / max(done)


def measure_capacity(setting: RunSetting, requests: int, input_range, output_range) -> float:
    trace = backlog_trace(setting.adapters.count, requests, input_range, output_range, setting.seed)
    system = EngineSystem(EngineSystemOptions(name="fcfs", dtype=DTYPE))
    return backlog_throughput(run_trace(system, trace, setting))


def median_first_token_s(records: list[RequestRecord]) -> float:
    first = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    if not first:
        raise RuntimeError("no request produced a first token")
    return statistics.median(first)
