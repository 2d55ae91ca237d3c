"""``loramesh status``'s DistKV-LLM table: per worker, the KV blocks it lends and borrows per peer,
what lending costs it, from the cumulative figures of its heartbeat (``WorkerLoad``), and the KV
overflow policy in force (the heartbeat's ``kv_overflow`` and ``lending_lane`` keys, beside
WorkerLoad's fields)."""

from __future__ import annotations

from collections.abc import Mapping

from loramesh_cli.table import render_table

DISTKV_KEYS = frozenset(
    {
        "lent_blocks",
        "borrowed_blocks",
        "remote_attention_s",
        "remote_attention_calls",
        "remote_bytes_sent",
        "remote_bytes_received",
        "lent_attention_s",
        "decode_steps",
    }
)
"""WorkerLoad keys of the heartbeat this table shows, left out of the status table's LOAD column."""

POLICY_KEYS = ("kv_overflow", "lending_lane")
"""The heartbeat keys (beside WorkerLoad's fields) of the worker's KV overflow policy in force
(``preempt`` or ``borrow``) and of how it reaches same-host creditors (``shared-memory``,
``socket`` or ``off``): the table's OVERFLOW column (``borrow/shared-memory``), also left out of
the LOAD column."""

HEADERS = [
    "WORKER",
    "LENT TO",
    "BORROWED FROM",
    "REMOTE ATTN",
    "ATTN/STEP",
    "BYTES/STEP OUT/IN",
    "LENT ATTN",
    "OVERFLOW",
]


def distkv_table(rows: list[dict]) -> str | None:
    """The table for the gpu_worker rows of ``loramesh status`` (None when there are none)."""
    workers = [r for r in rows if r["service"] == "gpu_worker" and r["load"]]
    if not workers:
        return None
    return render_table(HEADERS, [_row(r["instance"], r["load"]) for r in workers])


def _row(instance: str, load: Mapping) -> list[str]:
    steps = int(load.get("decode_steps", 0))
    waited = float(load.get("remote_attention_s", 0.0))
    sent, received = int(load.get("remote_bytes_sent", 0)), int(load.get("remote_bytes_received", 0))
    return [
        instance,
        _per_peer(load.get("lent_blocks", {})),
        _per_peer(load.get("borrowed_blocks", {})),
        f"{waited:.3f}s/{int(load.get('remote_attention_calls', 0))} calls",
        f"{1000 * waited / steps:.2f}ms" if steps else "-",
        f"{_bytes(sent / steps)}/{_bytes(received / steps)}" if steps else "-",
        f"{float(load.get('lent_attention_s', 0.0)):.3f}s",
        "/".join(str(load[key]) for key in POLICY_KEYS if key in load) or "-",
    ]


def _per_peer(blocks: Mapping[str, int]) -> str:
    return ",".join(f"{peer}:{count}" for peer, count in sorted(blocks.items())) or "-"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f}{unit}" if unit == "B" else f"{count:.1f}{unit}"
        count /= 1024
    return f"{count:.1f}GiB"
