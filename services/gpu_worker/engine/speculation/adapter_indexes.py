"""The ``suffix`` drafting indexes of one engine: one :class:`AdapterOutputIndex` per adapter
and tenant namespace, a bounded number of them.

An index is keyed by the adapter's id (its content's version, as the worker names it) and the
request's prefix-cache namespace (``tenant:<id>`` or ``salt:<cache_salt>``, set by the gateway):
a draft is never taken from another tenant's outputs, where an accepted draft would tell its
requester, through the timing of its tokens, what someone else's outputs said (the prefix
cache's isolation rule, docs/security.md). An adapter's indexes are dropped with it.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gpu_worker.engine.speculation.adapter_output_index import AdapterOutputIndex
from services.runtime.recently_used import RecentlyUsed

IndexKey = tuple[str | None, str]
"""(adapter id, None for the base model; prefix-cache namespace)."""


class AdapterIndexes:
    """At most ``max_indexes`` indexes, the least recently used dropped first."""

    def __init__(self, max_indexes: int, max_tokens: int, max_ngram: int):
        if max_indexes < 1:
            raise ValueError(f"max_indexes must be at least 1, got {max_indexes}")
        self.max_indexes = max_indexes
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self._indexes: RecentlyUsed[IndexKey, AdapterOutputIndex] = RecentlyUsed(max_indexes)

    def get(self, key: IndexKey) -> AdapterOutputIndex | None:
        """The index of ``key`` if it has one (marked recently used)."""
        return self._indexes.get(key)

    def add(self, key: IndexKey, output: list[int]) -> None:
        """Keep a finished request's ``output`` in its key's index (made if need be)."""
        index = self.get(key)
        if index is None:
            index = self._indexes.put(key, AdapterOutputIndex(self.max_tokens, self.max_ngram))
        index.add(output)

    def drop_unknown(self, known: Callable[[str], bool]) -> None:
        """Drop the indexes of adapters ``known`` no longer says the engine has."""
        self._indexes.drop(lambda key: key[0] is not None and not known(key[0]))

    def keys(self) -> list[IndexKey]:
        return self._indexes.keys()
