"""Worker heartbeats (``WorkerLoad`` JSON in etcd) into ledger rows.

A worker is in the ledger when it is a live ``gpu_worker`` member *and* has a well-formed load
report: a member without a report has told nothing about its blocks yet, and a report without
a member key belongs to a worker that is gone (or to another service: every service writes
``/loramesh/load/<id>``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from services.kv_manager.ledger import WorkerBlocks
from services.runtime.etcd.worker_load import worker_load_from_report

log = logging.getLogger("loramesh.kv_manager.heartbeats")


def ledger_rows(addresses: Mapping[str, str], reports: Mapping[str, Mapping[str, Any]]) -> list[WorkerBlocks]:
    """One row per worker in both ``addresses`` (``{id: address}``) and ``reports``."""
    rows = []
    for worker_id, address in sorted(addresses.items()):
        report = reports.get(worker_id)
        if report is None:
            continue
        try:
            load = worker_load_from_report(report)
        except ValueError as e:
            log.warning("ignoring the load report of %s: %s", worker_id, e)
            continue
        rows.append(
            WorkerBlocks(
                worker_id=worker_id,
                address=address,
                free_blocks=load.free_blocks,
                total_blocks=load.total_blocks,
                lent=dict(load.lent_blocks),
                topology=load.topology,
                lend_cap_blocks=load.lend_cap_blocks if load.HasField("lend_cap_blocks") else None,
                reported_at=load.ts,
            )
        )
    return rows
