"""The suffix indexes: one per adapter and tenant namespace, never shared across namespaces,
dropped with their adapter, the least recently used beyond the bound dropped first; a request
drafts from its adapter's index only when it matches a longer suffix than its own tokens."""

from __future__ import annotations

from services.gpu_worker.engine.speculation.adapter_indexes import AdapterIndexes
from services.gpu_worker.engine.speculation.draft_budget import DraftSettings
from services.gpu_worker.engine.speculation.request_drafter import RequestDrafter

OUTPUT = [30, 31, 32, 33, 34, 35]


def test_outputs_are_kept_per_adapter_and_tenant_namespace():
    indexes = AdapterIndexes(max_indexes=8, max_tokens=64, max_ngram=4)
    indexes.add(("sql-v1", "tenant:a"), OUTPUT)
    assert indexes.get(("sql-v1", "tenant:a")).match([31, 32], 2) == (2, (33, 34))
    # The same adapter for another tenant or cache salt, or another adapter: nothing to draft from.
    for key in (("sql-v1", "tenant:b"), ("sql-v1", "salt:x"), ("sql-v2", "tenant:a"), (None, "tenant:a")):
        assert indexes.get(key) is None


def test_an_adapters_indexes_go_with_it():
    indexes = AdapterIndexes(max_indexes=8, max_tokens=64, max_ngram=4)
    for key in (("sql-v1", "tenant:a"), ("sql-v1", "tenant:b"), ("chat-v3", "tenant:a"), (None, "tenant:a")):
        indexes.add(key, OUTPUT)
    indexes.drop_unknown(lambda adapter_id: adapter_id != "sql-v1")
    assert indexes.keys() == [("chat-v3", "tenant:a"), (None, "tenant:a")]


def test_the_least_recently_used_index_goes_first():
    indexes = AdapterIndexes(max_indexes=2, max_tokens=64, max_ngram=4)
    indexes.add(("a", ""), OUTPUT)
    indexes.add(("b", ""), OUTPUT)
    indexes.get(("a", ""))
    indexes.add(("c", ""), OUTPUT)
    assert indexes.keys() == [("a", ""), ("c", "")]


def test_a_request_drafts_from_the_source_with_the_longer_match():
    indexes = AdapterIndexes(max_indexes=2, max_tokens=64, max_ngram=6)
    indexes.add(("sql-v1", ""), [1, 2, 3, 4, 70, 71])
    drafter = RequestDrafter(DraftSettings(max_draft_tokens=2), indexes.get(("sql-v1", "")))
    # Its own tokens match "4" (one token, followed by 9); the adapter's output "2 3 4".
    assert drafter.propose([4, 9, 2, 3, 4], limit=5) == (70, 71)
    # Both match "2 3 4" now: a tie goes to its own tokens.
    assert drafter.propose([4, 9, 2, 3, 4, 8, 9, 2, 3, 4], limit=5) == (8, 9)
