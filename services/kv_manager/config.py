"""Settings of the kv_manager (flags ``--min-swap-blocks``, env ``LORAMESH_MIN_SWAP_BLOCKS``...)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.config import ServiceConfig, require_at_least, require_positive


@dataclass
class KVManagerConfig(ServiceConfig):
    """loramesh kv_manager: the global KV-block debt ledger, creditor suggestions and DGFM."""

    max_candidates: int = 3
    """Most creditors one SuggestCreditors answer names."""
    resort_interval_s: float = 0.1
    """Shortest time between two sorts of the workers by lendable blocks."""
    min_swap_blocks: int = 4
    """DGFM: smallest debt (in KV blocks) on a cycle worth swapping."""
    dgfm_interval_s: float = 10.0
    """DGFM: how often the leader plans and has the workers apply swaps (0: only on demand,
    through the Defragment RPC). A run waits for the heartbeats that follow the previous one."""
    dgfm_call_timeout_s: float = 60.0
    """DGFM: deadline of one worker's recall call (it waits for the worker's current step)."""
    retry_after_s: float = 1.0
    """Hint sent with RESOURCE_EXHAUSTED when no worker can lend (about one heartbeat)."""
    start_timeout_s: float = 10.0
    """How long start-up waits for etcd to list the workers and tell who leads."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(self, 1, "max_candidates", "min_swap_blocks")
        require_at_least(self, 0, "resort_interval_s", "dgfm_interval_s")
        require_positive(self, "dgfm_call_timeout_s", "retry_after_s", "start_timeout_s")
