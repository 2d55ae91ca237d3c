"""The speculative-decoding series: drafted and accepted tokens in all, and per adapter (named
as users name them, capped like every per-adapter series)."""

from __future__ import annotations

from services.gpu_worker.engine.speculation.speculator import BASE_MODEL
from services.gpu_worker.worker_metrics import _speculation_series
from services.runtime.capped_labels import OTHER, CappedLabels


def samples(drafted: dict[str, int], accepted: dict[str, int], cap: int) -> dict[tuple, float]:
    named = {"id-sql": "acme/sql", "id-chat": "acme/chat", "id-rare": "acme/rare"}.__getitem__
    labels = CappedLabels(["acme/sql", "acme/chat", "acme/rare"], {"acme/sql": 5, "acme/chat": 3}, cap)
    return {
        (s.name, s.labels.get("adapter")): s.value
        for family in _speculation_series(drafted, accepted, named, labels)
        for s in family.samples
    }


def test_drafted_and_accepted_per_adapter_and_in_all():
    drafted = {"id-sql": 40, "id-chat": 10, "id-rare": 4, BASE_MODEL: 6}
    accepted = {"id-sql": 30, "id-chat": 1, BASE_MODEL: 2}
    got = samples(drafted, accepted, cap=2)
    assert got[("loramesh_gpu_worker_draft_tokens_total", None)] == 60
    assert got[("loramesh_gpu_worker_accepted_draft_tokens_total", None)] == 33
    assert got[("loramesh_gpu_worker_adapter_draft_tokens_total", "acme/sql")] == 40
    assert got[("loramesh_gpu_worker_adapter_draft_tokens_total", OTHER)] == 4  # past the cap
    assert got[("loramesh_gpu_worker_adapter_accepted_draft_tokens_total", "acme/chat")] == 1
    assert not any(adapter == BASE_MODEL for _, adapter in got)
