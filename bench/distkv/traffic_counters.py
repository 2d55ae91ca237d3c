"""The DistKV traffic counters a worker's heartbeat carries (cumulative since it started), when
its build has them: remote-attention time and calls, lending-RPC bytes, decode steps."""

from __future__ import annotations

COUNTERS = (
    "remote_attention_s",
    "remote_attention_calls",
    "remote_bytes_sent",
    "remote_bytes_received",
    "lent_attention_s",
    "decode_steps",
)
"""WorkerLoad fields (types.proto); 64-bit counts arrive as JSON strings, hence ``float()``."""


def read_counters(load: dict) -> dict[str, float] | None:
    """The counters of one heartbeat, or None when the worker does not report them."""
    if not all(name in load for name in ("remote_attention_s", "decode_steps")):
        return None
    return {name: float(load.get(name, 0)) for name in COUNTERS}


def per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """What one decode step cost between two readings of the same worker (None: no step ran)."""
    steps = after["decode_steps"] - before["decode_steps"]
    if steps <= 0:
        return None
    delta = {name: after[name] - before[name] for name in COUNTERS}
    return {
        "steps": steps,
        "remote_attention_ms_per_step": 1000 * delta["remote_attention_s"] / steps,
        "remote_calls_per_step": delta["remote_attention_calls"] / steps,
        "bytes_sent_per_step": delta["remote_bytes_sent"] / steps,
        "bytes_received_per_step": delta["remote_bytes_received"] / steps,
    }
