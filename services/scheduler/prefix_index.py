"""Where the scheduler sent which prompt prefixes: an approximate, bounded index of the prompt
blocks each worker's prefix cache likely holds (SGLang's router keeps an approximate radix tree
of the same kind; llm-d scores on what the workers announce instead).

A block is the chain hash the gateway sends with a placement
(``PlaceRequest.prefix_blocks``, named as a worker's prefix cache names it:
:mod:`services.runtime.prefix_keys`). A chain hash stands for its whole prefix — every token
before it, the adapter version's (or the base model's) key space and the tenant's namespace — so
a prompt's cached prefix on a worker is the longest run of its blocks, from the first, that the
index holds for that worker, as the worker's own cache matches it. A prefix of adapter A never
counts for adapter B with other weights (their key spaces differ), and base-model blocks, an
activated LoRA's before its invocation included, count across adapters.

The index is a guess: it learns only from this scheduler's placements, not from what the worker
did (its LRU evicts under pool pressure, a restart empties it). It is bounded per worker
(least recently used blocks go first) and forgets a block ``ttl_s`` after its last placement;
a worker's entries go when it leaves the membership. A wrong guess costs a slower placement,
never a wrong answer: the worker checks its own keys.

No gRPC, no clock of its own (one is injected): the service and the cluster simulator share it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixIndexConfig:
    """Bounds of the scheduler's prefix index."""

    max_blocks_per_worker: int = 16384
    """Blocks remembered per worker at most (16,384 blocks of 16 tokens: 256k tokens, ~2 MB);
    past it the least recently placed go first, as a worker's cache evicts."""
    ttl_s: float = 600.0
    """A block not placed again within this many seconds is taken as evicted from the worker."""

    def __post_init__(self) -> None:
        if self.max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {self.max_blocks_per_worker}")
        if not math.isfinite(self.ttl_s) or self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be a finite number > 0, got {self.ttl_s}")


class PrefixIndex:
    """Per worker: block hash -> when it was last placed there, least recently placed first.
    Not thread-safe: use it from one event loop (or the simulator's)."""

    def __init__(self, config: PrefixIndexConfig | None = None, clock: Callable[[], float] = time.time):
        self.config = config or PrefixIndexConfig()
        self._clock = clock
        self._blocks: dict[str, OrderedDict[bytes, float]] = {}

    def record(self, worker_id: str, blocks: Sequence[bytes]) -> None:
        """``blocks`` (a prompt's, first to last) were placed on ``worker_id``. They are marked
        used from the last to the first, so the head of a chain, which the most prompts share,
        is the last to go (as the worker's cache releases a request's blocks)."""
        if not blocks:
            return
        held = self._blocks.setdefault(worker_id, OrderedDict())
        now = self._clock()
        for block in reversed(blocks):
            held[block] = now
            held.move_to_end(block)
        over = len(held) - self.config.max_blocks_per_worker
        for _ in range(max(0, over)):
            held.popitem(last=False)

    def hit_blocks(self, worker_id: str, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks``, from the first, ``worker_id`` likely holds."""
        held = self._blocks.get(worker_id)
        if not held:
            return 0
        oldest = self._clock() - self.config.ttl_s
        hits = 0
        for block in blocks:
            placed = held.get(block)
            if placed is None or placed < oldest:
                break
            hits += 1
        return hits

    def hits(self, worker_ids: Iterable[str], blocks: Sequence[bytes]) -> dict[str, int]:
        """``worker id -> hit_blocks`` for the workers that likely hold at least the first block."""
        found = {}
        for worker_id in worker_ids:
            if (count := self.hit_blocks(worker_id, blocks)) > 0:
                found[worker_id] = count
        return found

    def forget(self, worker_id: str) -> None:
        """Drop what the index holds for ``worker_id`` (it left: its cache went with it)."""
        self._blocks.pop(worker_id, None)

    def expire(self) -> int:
        """Drop every block past its TTL; returns how many went (placements keep the index
        bounded, this keeps a quiet worker's stale blocks from lingering in memory)."""
        oldest = self._clock() - self.config.ttl_s
        dropped = 0
        for held in self._blocks.values():
            while held:
                block, placed = next(iter(held.items()))
                if placed >= oldest:
                    break
                del held[block]
                dropped += 1
        return dropped

    def size(self, worker_id: str | None = None) -> int:
        """Blocks held for ``worker_id``, or for every worker (None)."""
        if worker_id is not None:
            return len(self._blocks.get(worker_id, ()))
        return sum(len(held) for held in self._blocks.values())
