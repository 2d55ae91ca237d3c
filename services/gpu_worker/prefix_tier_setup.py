"""A serving worker's part in the cluster prefix tier, assembled from its settings
(``--cluster-prefix-cache``, ``--prefix-fetch-mb-s``, ``--prefill-gflops``): the journal its prefix
cache announces through, the kv_manager index and the peers over gRPC, the cost model from its
model and pool, and the announcement loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.memory.prefix_fetch_cost import PrefixFetchCost, decoder_flops_per_token
from services.gpu_worker.memory.prefix_journal import PrefixJournal
from services.gpu_worker.prefix_tier import ClusterPrefixTier, PrefixTierSettings
from services.gpu_worker.prefix_tier_grpc import GrpcPrefixDirectory, GrpcPrefixPeers
from services.runtime.security.tls import NO_TLS, TLSConfig

ROUND_TRIP_S = 0.002
"""A lookup at the kv_manager and a fetch's first message on one network (loopback ~1 ms)."""


def kv_identity(model: str, dtype: torch.dtype, quantization: str, block_tokens: int) -> str:
    """What must agree for one worker's KV block to be another's: the base model, the compute
    dtype, the weights' format (quantized weights make other KV) and the block size."""
    return f"{model}/{str(dtype).removeprefix('torch.')}/{quantization}/{block_tokens}"


def fetch_cost(engine: Engine, prefix_fetch_mb_s: float, prefill_gflops: float) -> PrefixFetchCost:
    layout = engine.pool.layout
    element = torch.empty((), dtype=engine.pool.dtype).element_size()
    return PrefixFetchCost(
        block_tokens=layout.kv_block_tokens,
        block_bytes=layout.num_layers * layout.page_elems * element,
        flops_per_token=decoder_flops_per_token(engine.executor.config),
        prefill_flops_per_s=prefill_gflops * 1e9,
        lane_bytes_per_s=prefix_fetch_mb_s * 1e6,
        round_trip_s=ROUND_TRIP_S,
    )


@dataclass
class PrefixTierParts:
    """A started tier and what stops it."""

    tier: ClusterPrefixTier
    announcing: asyncio.Task[None]
    directory: GrpcPrefixDirectory
    peers: GrpcPrefixPeers

    async def close(self) -> None:
        self.announcing.cancel()
        await asyncio.gather(self.announcing, return_exceptions=True)
        await self.directory.close()
        await self.peers.close()


def start_prefix_tier(
    engine: Engine,
    settings: PrefixTierSettings,
    kv_managers: Callable[[], Sequence[str]],
    *,
    prefix_fetch_mb_s: float,
    prefill_gflops: float,
    tls: TLSConfig = NO_TLS,
) -> PrefixTierParts:
    """Journal ``engine``'s prefix cache and start announcing to the kv_managers at
    ``kv_managers()`` (event loop). The cache must be on and empty still (a new engine)."""
    journal = PrefixJournal(max_pending=settings.max_keys_per_call)
    engine.prefix_cache.journal = journal
    directory, peers = GrpcPrefixDirectory(kv_managers, tls), GrpcPrefixPeers(tls)
    tier = ClusterPrefixTier(
        engine, settings, journal, directory, peers, fetch_cost(engine, prefix_fetch_mb_s, prefill_gflops)
    )
    task = asyncio.get_running_loop().create_task(tier.run_announcements(), name="gpu_worker:prefix-announce")
    return PrefixTierParts(tier, task, directory, peers)
