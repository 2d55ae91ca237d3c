"""What a simulated (or measured) run amounts to: the figures of the issue-16 table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.cluster_sim.simulator import SimResult


@dataclass(frozen=True)
class RunSummary:
    requests: int
    finished: int
    p50_latency_s: float
    p99_latency_s: float
    mean_latency_s: float
    slo_attainment: float
    """Share of requests whose first token came within the SLO (unfinished ones miss it)."""
    throughput_rps: float
    """Finished requests per second, first arrival to last completion."""
    tokens_per_s: float
    migrations_per_min: float
    prefetches: int
    preemptions: int
    """Running requests a full pool sent back to the queue (their context recomputed)."""
    decode_bound_p99_s: float
    """p99 of the time from first token to last: what the latency would be if no request
    waited for a slot, a fetch or its prefill (the floor for migration and prefetch, which only
    shorten waits)."""


def summarize(result: SimResult, slo_s: float) -> RunSummary:
    done = [r for r in result.requests if r.finish_s is not None]
    latency = np.array([r.finish_s - r.arrival_s for r in done]) if done else np.array([np.nan])
    met = sum(
        1 for r in result.requests if r.first_token_s is not None and r.first_token_s - r.arrival_s <= slo_s
    )
    start = min((r.arrival_s for r in result.requests), default=0.0)
    span = max((r.finish_s for r in done), default=start) - start
    minutes = max(span, 1e-9) / 60.0
    return RunSummary(
        requests=len(result.requests),
        finished=len(done),
        p50_latency_s=float(np.percentile(latency, 50)),
        p99_latency_s=float(np.percentile(latency, 99)),
        mean_latency_s=float(latency.mean()),
        slo_attainment=met / max(1, len(result.requests)),
        throughput_rps=len(done) / max(span, 1e-9),
        tokens_per_s=sum(r.output_len for r in done) / max(span, 1e-9),
        migrations_per_min=result.migrations / minutes,
        prefetches=result.prefetches,
        preemptions=result.preemptions,
        decode_bound_p99_s=float(np.percentile([r.finish_s - r.first_token_s for r in done] or [np.nan], 99)),
    )
