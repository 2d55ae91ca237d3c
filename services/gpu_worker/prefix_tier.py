"""The cluster prefix tier on a worker: its prefix cache's keys announced to the kv_manager's
index, and a prompt's prefix fetched from the worker holding it instead of recomputed here.

Before a request is queued, :meth:`ClusterPrefixTier.prepare` looks at its prompt's whole
blocks (the keys the engine will look up: ``services/runtime/prefix_keys.py``). When this
worker lacks some leading blocks that another holds and :class:`PrefixFetchCost` says fetching
them is faster than computing them, it fetches them, checks each is the key it asked for, of
this pool's shape and dtype, and caches them here between two steps; the engine then finds them
as local hits. Whatever goes wrong (index or holder unreachable, a block evicted meanwhile, a
holder that answers another key) leaves the request to compute what it lacks: the tier can make
a prefill shorter, never a block wrong.

No gRPC here: the index and the holders are reached through :class:`PrefixDirectory` and
:class:`PrefixPeers` (``services/gpu_worker/prefix_tier_grpc.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.memory.prefix_cache import BlockKey
from services.gpu_worker.memory.prefix_fetch_cost import PrefixFetchCost
from services.gpu_worker.memory.prefix_journal import PrefixJournal
from services.runtime.errors import DomainError
from services.runtime.prefix_keys import request_block_keys

log = logging.getLogger("loramesh.worker.prefix_tier")

FETCH_DEADLINE_FLOOR_S = 1.0
"""The least a fetch is given, whatever the cost model expects (a loaded host's first call)."""


@dataclass(frozen=True)
class RemotePrefix:
    """Where the index says a prefix is."""

    holder_id: str
    address: str
    blocks: int
    """Leading keys of the lookup it holds."""


class PrefixDirectory(Protocol):
    """The kv_manager's prefix index."""

    async def announce(
        self, worker_id: str, kv_identity: str, added: list[BlockKey], removed: list[BlockKey], replace: bool
    ) -> str:
        """Record a batch; returns the index's incarnation id."""

    async def locate(self, worker_id: str, kv_identity: str, keys: Sequence[BlockKey]) -> RemotePrefix | None:
        """The other worker holding the longest leading run of ``keys`` (None: none does)."""


class PrefixPeers(Protocol):
    """Other workers' prefix caches."""

    async def fetch(
        self, address: str, kv_identity: str, keys: Sequence[BlockKey], deadline_s: float
    ) -> list[tuple[BlockKey, torch.Tensor]]:
        """The blocks the worker at ``address`` holds of the leading ``keys``: (key, KV) pairs in
        the order it sent them, within ``deadline_s``."""


@dataclass(frozen=True)
class PrefixTierSettings:
    """How a worker takes part in the tier."""

    worker_id: str
    """This worker's instance id."""
    kv_identity: str
    """Model, dtype, weights format and block size: blocks are exchanged only within one."""
    announce_interval_s: float = 0.5
    """How often cached and evicted keys are announced (an empty announcement too: it tells a
    new index from the old, so the whole set is sent to a kv_manager that restarted)."""
    max_keys_per_call: int = 4096
    """Keys one announcement carries (the index's bound)."""


@dataclass
class PrefixTierCounters:
    """Counts since start (the worker's metrics)."""

    local_hit_blocks: int = 0
    """Prompt blocks found in this worker's cache when the request arrived."""
    remote_hit_blocks: int = 0
    """Prompt blocks this worker lacked that the index placed on another worker."""
    fetched_blocks: int = 0
    """Blocks fetched, checked and cached here."""
    tokens_saved: int = 0
    """Prompt tokens of the fetched blocks: prefill this worker did not compute."""
    rejected_blocks: int = 0
    """Blocks a holder sent that were not what was asked (another key, shape or dtype): dropped."""
    fetches_skipped: int = 0
    """Remote prefixes left to recompute because the cost model said computing was faster."""
    fetch_seconds: float = 0.0
    """Time spent in fetches that returned (the lane's speed, with ``fetched_blocks``)."""


class ClusterPrefixTier:
    """One worker's side of the tier (event loop; the cache is changed on the engine thread)."""

    def __init__(
        self,
        engine: Engine,
        settings: PrefixTierSettings,
        journal: PrefixJournal,
        directory: PrefixDirectory,
        peers: PrefixPeers,
        cost: PrefixFetchCost,
    ):
        if engine.prefix_cache is None:
            raise ValueError("the cluster prefix tier needs the prefix cache on (--prefix-cache)")
        self.engine = engine
        self.cache = engine.prefix_cache
        self.settings = settings
        self.journal = journal
        self.directory = directory
        self.peers = peers
        self.cost = cost
        self.counters = PrefixTierCounters()
        self.index_id = ""
        """The incarnation of the index last announced to."""
        layout = engine.pool.layout
        self._block_shape = (layout.num_layers, 2 * layout.kv_block_tokens, layout.kv_dim)

    async def run_announcements(self) -> None:
        """Announce every ``announce_interval_s`` until cancelled."""
        while True:
            await self.announce()
            await asyncio.sleep(self.settings.announce_interval_s)

    async def announce(self) -> None:
        """Send what the cache cached and evicted since the last call (the whole set when the
        index is new to this worker or a batch was lost)."""
        batch = self.journal.drain()
        limit = self.settings.max_keys_per_call
        chunks = [batch.added[i : i + limit] for i in range(0, len(batch.added), limit)] or [[]]
        removed = [batch.removed[i : i + limit] for i in range(0, len(batch.removed), limit)]
        s = self.settings
        try:
            index_id = ""
            for number, added in enumerate(chunks):
                index_id = await self.directory.announce(
                    s.worker_id, s.kv_identity, added, [], replace=batch.replace and number == 0
                )
            for keys in removed:
                index_id = await self.directory.announce(s.worker_id, s.kv_identity, [], keys, replace=False)
        except DomainError as error:
            log.debug("prefix announcement not delivered (%s): the whole set goes next time", error)
            self.journal.resend_all()
            return
        if index_id != self.index_id and not batch.replace:
            self.journal.resend_all()  # a new index: it has none of what was announced before
        self.index_id = index_id

    async def prepare(self, request: GenerationRequest) -> None:
        """Fetch the leading prompt blocks this worker lacks from the worker holding them, when
        that is cheaper than computing them (see the module's docstring)."""
        keys = self._usable_keys(request)
        if not keys:
            return
        # Read from the event loop without the engine's step: advice only, the engine looks again.
        local = self.cache.cached_run(keys)
        self.counters.local_hit_blocks += local
        if local == len(keys) or not self.cost.worth_fetching(len(keys) - local):
            return
        s = self.settings
        try:
            found = await self.directory.locate(s.worker_id, s.kv_identity, keys)
        except DomainError as error:
            log.debug("prefix lookup failed (%s): the prompt is computed here", error)
            return
        if found is None or found.blocks <= local:
            return
        missing = found.blocks - local
        self.counters.remote_hit_blocks += missing
        if not self.cost.worth_fetching(missing):
            self.counters.fetches_skipped += 1
            return
        wanted = keys[local : found.blocks]
        try:
            # A fetch slower than computing the blocks twice is given up: a hung holder costs a
            # bounded wait, then the recompute the request would have done anyway.
            deadline_s = FETCH_DEADLINE_FLOOR_S + 2 * self.cost.prefill_s(missing)
            started = time.perf_counter()
            got = await self.peers.fetch(found.address, s.kv_identity, wanted, deadline_s)
        except DomainError as error:
            log.info("prefix fetch from %s failed (%s): computed here", found.holder_id, error)
            return
        self.counters.fetch_seconds += time.perf_counter() - started
        blocks = self._checked(wanted, got, found.holder_id)
        if not blocks:
            return
        kv = torch.stack(blocks)
        imported = await asyncio.wrap_future(
            self.engine.between_steps(lambda: self.cache.import_blocks(wanted[: len(blocks)], kv))
        )
        self.counters.fetched_blocks += imported
        self.counters.tokens_saved += imported * self.engine.pool.layout.kv_block_tokens

    def _usable_keys(self, request: GenerationRequest) -> list[BlockKey]:
        """The keys of the prompt blocks the engine could take from its cache (the last token
        is always computed); none for a resumed request or an adapter of unknown content."""
        if request.resumed_output_tokens:
            return []
        adapter = None
        if request.adapter_id is not None:
            held = self.engine.host_adapters.get(request.adapter_id)
            if held is None:
                return []
            adapter = held.identity
        block = self.engine.pool.layout.kv_block_tokens
        keys = request_block_keys(request.prefix_cache_namespace, request.prompt_ids, block, adapter) or []
        return keys[: (len(request.prompt_ids) - 1) // block]

    def _checked(
        self, wanted: Sequence[BlockKey], got: list[tuple[BlockKey, torch.Tensor]], holder: str
    ) -> list[torch.Tensor]:
        """The leading blocks of ``got`` that are what was asked, in order; the rest dropped."""
        blocks = []
        for key, (sent_key, kv) in zip(wanted, got, strict=False):
            if sent_key != key or tuple(kv.shape) != self._block_shape or kv.dtype != self.engine.pool.dtype:
                log.warning(
                    "prefix block %d from %s is not the one asked for (key %s, shape %s, %s): dropped",
                    len(blocks), holder, sent_key.hex()[:12], tuple(kv.shape), kv.dtype,
                )  # fmt: skip
                self.counters.rejected_blocks += len(got) - len(blocks)
                break
            blocks.append(kv)
        return blocks
