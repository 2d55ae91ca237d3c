"""What each gpu_worker of a local mesh runs: its base weights' format and its activation dtype,
as its load report in etcd states them (the worker resolves ``--quantization auto`` and
``--dtype auto`` at start, from the model and the machine), for `loramesh up`'s summary."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping
from typing import Any

from services.runtime.errors import Unavailable
from services.runtime.etcd.membership import MembershipConfig, read_loads
from services.runtime.security.tls import TLSConfig

REPORT_WAIT_S = 60.0
"""How long `up` waits for its ready workers' load reports, which each writes every second: a
guard against a worker that died since, not a timing claim; past it, the summary leaves out
the workers that did not report."""


def describe_format(report: Mapping[str, Any]) -> str:
    """``weights q4_1, activations bfloat16``; unquantized weights are held in the activation
    dtype; empty when the report does not say."""
    quantization, dtype = report.get("quantization"), report.get("dtype")
    if not quantization or not dtype:
        return ""
    weights = f"{dtype} (unquantized)" if quantization == "none" else f"{quantization} (quantized blocks)"
    return f"weights {weights}, activations {dtype}"


async def read_worker_formats(
    etcd_endpoint: str, tls: TLSConfig, workers: Collection[str], wait_s: float = REPORT_WAIT_S
) -> dict[str, str]:
    """Each of ``workers`` (instance ids) → :func:`describe_format` of its load report, waiting
    up to ``wait_s`` for the reports; a worker without one yet is left out."""
    config = MembershipConfig(etcd_endpoints=etcd_endpoint, tls=tls)
    deadline = time.monotonic() + wait_s
    formats: dict[str, str] = {}
    while True:
        try:
            loads = await read_loads(config)
        except Unavailable:
            loads = {}
        formats = {name: text for name in workers if (text := describe_format(loads.get(name, {})))}
        if len(formats) == len(workers) or time.monotonic() >= deadline:
            return formats
        await asyncio.sleep(0.2)
