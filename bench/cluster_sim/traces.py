"""The issue-16 traces: bursty, skewed S-LoRA workloads, and one whose popularity shifts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bench.workload import TraceRequest, WorkloadSpec, generate


def shifted(spec: WorkloadSpec) -> list[TraceRequest]:
    """``spec`` for the first half; for the second half the same kind of trace with the adapters'
    popularity permuted at random (the hot adapters of the second half were cold before)."""
    half = spec.duration_s / 2
    first = generate(replace(spec, duration_s=half))
    second = generate(replace(spec, duration_s=half, seed=spec.seed + 1))
    order = np.random.default_rng(spec.seed + 2).permutation(spec.adapters)
    moved = [
        replace(
            r,
            time_s=round(r.time_s + half, 6),
            adapter=int(order[r.adapter]),
            rank=spec.ranks[int(order[r.adapter]) % len(spec.ranks)],
            request_id=f"late-{r.request_id}",
        )
        for r in second
    ]
    return first + moved
