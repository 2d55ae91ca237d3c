"""The cluster prefix tier's index: which live worker holds which prefix-cache blocks.

Workers announce the chain keys of the blocks their prefix cache holds (and those it evicts),
in batches, within a KV identity (base model, dtype, weights format, block size: a block's
bytes are another worker's only when all four agree). A key names a block's whole prompt
prefix in one adapter version's key space and one tenant's namespace
(``services/gpu_worker/memory/prefix_cache.py``), so the index never needs to know which.

The index is advice and may be stale: an entry of a block evicted since, or of a worker that
died, costs the fetcher a shorter answer and a recompute, never a wrong block (the holder sends
only blocks it holds under the asked keys, and the fetcher checks each key). Entries are
bounded per worker (the oldest announced go first) and dropped with the worker's etcd lease.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.runtime.errors import InvalidArgument

IndexKey = tuple[str, bytes]
"""(KV identity, chain key)."""


@dataclass(frozen=True)
class PrefixIndexConfig:
    """Bounds of the index."""

    max_blocks_per_worker: int = 65_536
    """Entries kept per worker; past it the oldest announced are forgotten (a 1,000-token prompt
    of 16-token blocks is 63)."""
    max_keys_per_call: int = 4_096
    """Keys one announcement or lookup may carry (workers send bigger sets in several)."""


@dataclass(frozen=True)
class PrefixHolder:
    """A lookup's answer."""

    worker_id: str
    """The holder ('' when no other worker holds the first key)."""
    blocks: int
    """Leading keys it holds."""


class PrefixIndex:
    """Chain keys by holder and holders by chain key (event loop only)."""

    def __init__(self, config: PrefixIndexConfig | None = None):
        self.config = config or PrefixIndexConfig()
        self._holders: dict[IndexKey, set[str]] = {}
        self._held: dict[str, OrderedDict[IndexKey, None]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def held(self, worker_id: str) -> int:
        """Entries the index keeps for ``worker_id``."""
        return len(self._held.get(worker_id, ()))

    def announce(
        self,
        worker_id: str,
        kv_identity: str,
        added: Sequence[bytes],
        removed: Sequence[bytes],
        replace: bool = False,
    ) -> int:
        """Record what ``worker_id`` cached and evicted (``replace``: ``added`` is its whole set);
        returns its entries after."""
        if not worker_id:
            raise InvalidArgument("AnnouncePrefixBlocks needs worker_id: the announcing worker")
        if not kv_identity:
            raise InvalidArgument("AnnouncePrefixBlocks needs kv_identity: the model its blocks are of")
        self._check_size("AnnouncePrefixBlocks", len(added) + len(removed))
        if replace:
            self.forget(worker_id)
        held = self._held.setdefault(worker_id, OrderedDict())
        for key in removed:
            self._drop(worker_id, held, (kv_identity, key))
        for key in added:
            entry = (kv_identity, key)
            held[entry] = None
            held.move_to_end(entry)
            self._holders.setdefault(entry, set()).add(worker_id)
        while len(held) > self.config.max_blocks_per_worker:
            self._drop(worker_id, held, next(iter(held)))
        return len(held)

    def locate(self, asker: str, kv_identity: str, keys: Sequence[bytes]) -> PrefixHolder:
        """The worker other than ``asker`` holding the longest leading run of ``keys`` (ties: the
        first by id, so answers are repeatable)."""
        self._check_size("LocatePrefix", len(keys))
        candidates: set[str] = set()
        run = 0
        for index, key in enumerate(keys):
            holders = self._holders.get((kv_identity, key), set()) - {asker}
            narrowed = holders if index == 0 else candidates & holders
            if not narrowed:
                break
            candidates, run = narrowed, index + 1
        if not run:
            return PrefixHolder("", 0)
        return PrefixHolder(min(candidates), run)

    def forget(self, worker_id: str) -> int:
        """Drop every entry of ``worker_id`` (gone, or replacing its set); returns how many."""
        held = self._held.pop(worker_id, OrderedDict())
        for entry in held:
            self._unhold(worker_id, entry)
        return len(held)

    def retain(self, live: Iterable[str]) -> list[str]:
        """Forget every worker not in ``live``; returns those forgotten."""
        gone = sorted(self._held.keys() - set(live))
        for worker_id in gone:
            self.forget(worker_id)
        return gone

    def holders_by_worker(self) -> Mapping[str, int]:
        """Entries per worker (for the load report)."""
        return {worker_id: len(held) for worker_id, held in self._held.items()}

    def _check_size(self, what: str, count: int) -> None:
        if count > self.config.max_keys_per_call:
            raise InvalidArgument(
                f"{what}: {count} keys in one call, more than the {self.config.max_keys_per_call} allowed"
            )

    def _drop(self, worker_id: str, held: OrderedDict[IndexKey, None], entry: IndexKey) -> None:
        if entry in held:
            del held[entry]
            self._unhold(worker_id, entry)

    def _unhold(self, worker_id: str, entry: IndexKey) -> None:
        holders = self._holders.get(entry)
        if holders is None:
            return
        holders.discard(worker_id)
        if not holders:
            del self._holders[entry]
