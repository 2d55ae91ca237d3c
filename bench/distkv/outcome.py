"""What happened to each request of a run, and a run's figures from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STATUSES = ("completed", "refused", "failed", "stuck")
"""completed: every token came; refused: the worker answered an error status at once (e.g. a
prompt larger than its pool); failed: any other error; stuck: an idle worker held it queued
without ever running it (it can never get its KV), so the benchmark cancelled it."""


@dataclass
class RequestOutcome:
    """One request as its client saw it; times are seconds since the run started."""

    request_id: str
    worker: int
    """Index of the worker it was sent to."""
    prompt_tokens: int
    long: bool
    """Longer than one pool."""
    status: str = "completed"
    """One of ``STATUSES``."""
    detail: str = ""
    """The status message, when not completed."""
    output_tokens: int = 0
    started_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    """When each generated token arrived."""
    preemptions: int = 0
    """Times the worker recomputed it (from its final timings)."""

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def decode_step_s(self) -> float | None:
        """Mean time between its generated tokens (None with fewer than two)."""
        if len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (len(self.token_times_s) - 1)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None}
    array = np.asarray(values)
    return {
        "p50": round(float(np.percentile(array, 50)), 3),
        "p90": round(float(np.percentile(array, 90)), 3),
        "max": round(float(array.max()), 3),
    }


def summarize(outcomes: list[RequestOutcome], wall_s: float) -> dict:
    """Counts per status (all, and long ones), tokens/s over the run's wall time, latencies."""
    done = [o for o in outcomes if o.status == "completed"]
    output = sum(o.output_tokens for o in done)
    served = sum(o.prompt_tokens + o.output_tokens for o in done)
    steps = [s for o in done if (s := o.decode_step_s) is not None]
    return {
        "requests": len(outcomes),
        "long_requests": sum(o.long for o in outcomes),
        **{status: sum(o.status == status for o in outcomes) for status in STATUSES},
        **{f"long_{status}": sum(o.long and o.status == status for o in outcomes) for status in STATUSES},
        "wall_s": round(wall_s, 3),
        "output_tokens": output,
        "output_tokens_per_s": round(output / wall_s, 3) if wall_s > 0 else 0.0,
        "served_tokens_per_s": round(served / wall_s, 3) if wall_s > 0 else 0.0,
        "latency_s": _percentiles([o.latency_s for o in done]),
        "short_latency_s": _percentiles([o.latency_s for o in done if not o.long]),
        "long_latency_s": _percentiles([o.latency_s for o in done if o.long]),
        "mean_decode_step_ms": round(1000 * float(np.mean(steps)), 2) if steps else None,
        "preemptions": sum(o.preemptions for o in outcomes),
    }
