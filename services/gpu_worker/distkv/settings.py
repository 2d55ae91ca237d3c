"""The engine's DistKV settings, apart from the wing that builds DistKV from them so that the
engine's config can name them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

AUTO_LEND_SHARE = 0.75
"""Share of its pool's KV blocks a worker lends at most by default (``max_lent_blocks`` −1):
three idle workers with 1,090-token pools serve a 2,500-token prompt, and a quarter of each pool
stays its own."""


@dataclass(frozen=True)
class DistKvSettings:
    """The engine's DistKV settings (``EngineConfig``'s, resolved)."""

    worker_id: str
    """This worker's instance id: what creditors and the gManager's ledger know it by."""
    max_lent_blocks: int
    """KV blocks other workers may borrow at most, all together; −1: :data:`AUTO_LEND_SHARE` of
    the pool's blocks."""
    lend_compute_share: float
    """Share of wall time spent attending over lent blocks while busy (the compute cap)."""
    lend_compute_window_s: float
    """The compute cap's sliding window, in seconds."""
    borrow: bool
    """Borrow blocks from other workers when the pool runs dry (else preempt)."""
    deterministic: bool
    """Batch-invariant attention over block tables."""
