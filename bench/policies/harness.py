"""One run of one system on one trace, summarised for the results file."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.serving.metrics import summarize
from bench.systems.base import AdapterSet, RequestRecord, RunContext, ServingSystem
from bench.workload import TraceRequest


@dataclass(frozen=True)
class RunSetting:
    """What a run needs besides the trace and the system."""

    adapters: AdapterSet
    window_s: float
    max_batch: int
    pool_mib: float
    seed: int
    slo_s: float = 1.0
    """First-token SLO for :func:`bench.serving.metrics.summarize` (the abort experiment
    scores its own SLO with :mod:`bench.policies.satisfaction`)."""


def trace_seconds(requests: int, rate: float) -> float:
    """How long a trace of ``requests`` expected requests at ``rate`` per second lasts."""
    return requests / rate


def window_s(requests: int, rate: float, capacity_rps: float, drain_s: float) -> float:
    """A run's window: the trace, then as long as its requests take as one backlog at the
    measured capacity, plus ``drain_s``."""
    return trace_seconds(requests, rate) + requests / capacity_rps + drain_s


def run_trace(system: ServingSystem, trace: list[TraceRequest], setting: RunSetting) -> list[RequestRecord]:
    """The system's records of ``trace`` (none for an empty trace: a short bursty trace may hold
    no request at all)."""
    if not trace:
        return []
    context = RunContext(
        trace=trace,
        adapters=setting.adapters,
        window_s=setting.window_s,
        max_batch=setting.max_batch,
        pool_mib=setting.pool_mib,
        host_cache_mib=1024,
        seed=setting.seed,
    )
    return system.run(context)


def summary(system: ServingSystem, records: list[RequestRecord], setting: RunSetting) -> dict:
    """The serving metrics, the median first-token latency and the system's own counters."""
    metrics = summarize(records, setting.window_s, setting.slo_s).to_dict()
    first = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    return {
        "system": system.name,
        **{k: _round(v) for k, v in metrics.items()},
        "median_first_token_s": _round(statistics.median(first)) if first else None,
        "system_stats": getattr(system, "stats", dict)(),
    }


def _round(value):
    return round(value, 4) if isinstance(value, float) else value
