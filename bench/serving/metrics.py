"""Serving metrics of one run, as S-LoRA §7.1 reports them, plus user satisfaction.

- Throughput: completed requests per second, and output tokens per second (every token produced
  within the window, also by requests still running at its end: on a short saturated run the
  batch in flight holds a large share of the work), the run lasting until the last completion
  or the end of the window, whichever is first.
- Latency: arrival to last token of completed requests (average and p99).
- First-token latency: arrival to first token, averaged over requests that produced one.
- SLO attainment: share of *all* requests whose first token came within the SLO (a request
  without a first token missed it).
- User satisfaction (S-LoRA Appendix B's idea: a shorter first-token latency satisfies more,
  and a missed SLO satisfies nobody). We use the linear form: a request with first-token
  latency ``t`` scores ``max(0, 1 - t / SLO)``; a request without a first token scores 0; the
  metric is the average over all requests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from bench.systems.base import RequestRecord


@dataclass(frozen=True)
class RunMetrics:
    requests: int
    """Requests in the trace."""
    completed: int
    """Requests that produced all their tokens within the window."""
    duration_s: float
    """Seconds the throughput is taken over."""
    throughput_rps: float
    throughput_tps: float
    """Output tokens produced per second, by completed requests and by those cut by the window."""
    avg_latency_s: float | None
    p99_latency_s: float | None
    avg_first_token_s: float | None
    p99_first_token_s: float | None
    slo_s: float
    slo_attainment: float
    """Share of requests (0..1) with their first token within ``slo_s``."""
    user_satisfaction: float
    """Average of ``max(0, 1 - first_token / slo_s)`` over all requests (0..1)."""

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], window_s: float, slo_s: float) -> RunMetrics:
    completed = [r for r in records if r.completed]
    finished_all = len(completed) == len(records)
    last = max((r.finish_s for r in completed), default=window_s) if finished_all else window_s
    duration = max(1e-9, min(window_s, last))
    latencies = np.array([r.finish_s - r.arrival_s for r in completed])
    first = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    first_all = np.array(first)
    scores = [max(0.0, 1.0 - t / slo_s) for t in first]
    return RunMetrics(
        requests=len(records),
        completed=len(completed),
        duration_s=duration,
        throughput_rps=len(completed) / duration,
        throughput_tps=sum(r.output_tokens for r in records) / duration,
        avg_latency_s=float(latencies.mean()) if len(latencies) else None,
        p99_latency_s=float(np.percentile(latencies, 99)) if len(latencies) else None,
        avg_first_token_s=float(first_all.mean()) if len(first) else None,
        p99_first_token_s=float(np.percentile(first_all, 99)) if len(first) else None,
        slo_s=slo_s,
        slo_attainment=sum(t <= slo_s for t in first) / len(records) if records else 0.0,
        user_satisfaction=sum(scores) / len(records) if records else 0.0,
    )
