"""Batch policies of the engine, one file per policy behind :class:`BatchPolicy`.

:func:`make_batch_policy` builds the policy ``--batch-policy`` names, with its default knobs
(early_abort's first-token SLO excepted: ``--early-abort-slo-s``).
"""

from __future__ import annotations

from services.gpu_worker.engine.policies.adapter_clustering import AdapterClustering
from services.gpu_worker.engine.policies.batch_policy import BatchPolicy
from services.gpu_worker.engine.policies.dlora import DynamicBatching
from services.gpu_worker.engine.policies.early_abort import EarlyAbort, EarlyAbortConfig
from services.gpu_worker.engine.policies.fcfs import Fcfs
from services.gpu_worker.engine.policies.hrrn import Hrrn
from services.gpu_worker.engine.policies.lcfs import Lcfs
from services.gpu_worker.engine.policies.pets_prefill import PetsPrefill

BATCH_POLICIES: dict[str, type] = {
    cls.name: cls for cls in (Fcfs, Lcfs, EarlyAbort, AdapterClustering, DynamicBatching, PetsPrefill, Hrrn)
}
"""``--batch-policy`` name -> policy class (each builds with its default configuration)."""


def make_batch_policy(name: str, early_abort_slo_s: float | None = None) -> BatchPolicy:
    """A fresh batch policy by name; ValueError naming the known ones otherwise.
    ``early_abort_slo_s``: early_abort's first-token SLO (None: its default, 6 s); the other
    policies ignore it."""
    try:
        cls = BATCH_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(BATCH_POLICIES))
        raise ValueError(f"unknown batch policy {name!r}; known: {known}") from None
    if cls is EarlyAbort and early_abort_slo_s is not None:
        return EarlyAbort(EarlyAbortConfig(first_token_slo_s=early_abort_slo_s))
    return cls()
