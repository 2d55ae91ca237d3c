"""What the nemesis observes of the cluster besides its clients' operations, for the checker:
the store's final state, the workers' KV-block reports, the kv_manager leaders' terms and
writes, and how long each service took to serve again after each fault was healed.

Plain records, no I/O: the runner fills them (from the store's API, the load reports in etcd,
the leader key's revisions, the health checks) on the history's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoreObservation:
    """The adapter store at the end of the run, after every fault was healed."""

    listed: frozenset[str]
    """Every name the store lists (all pages)."""
    digests: Mapping[str, str] = field(default_factory=dict)
    """name -> sha256 (hex) of the weights fetched now, for the names the checker asked about."""
    fetch_errors: Mapping[str, str] = field(default_factory=dict)
    """name -> why its fetch failed (status code name first)."""


@dataclass(frozen=True)
class BlockReport:
    """One gpu_worker's KV blocks as its heartbeat (``WorkerLoad``) states them."""

    worker_id: str
    free_blocks: int = 0
    total_blocks: int = 0
    lent: Mapping[str, int] = field(default_factory=dict)
    """debtor id -> blocks this worker holds for it."""
    borrowed: Mapping[str, int] = field(default_factory=dict)
    """creditor id -> blocks of this worker's requests that creditor holds."""
    lend_cap_blocks: int | None = None
    """Most blocks the worker lends in all; None: only its free blocks limit it."""

    @classmethod
    def from_load(cls, worker_id: str, load: Mapping) -> BlockReport:
        """From the JSON of ``/loramesh/load/<worker_id>`` (protobuf's JSON mapping: zero
        counts and empty maps are left out)."""
        cap = load.get("lend_cap_blocks")
        return cls(
            worker_id=worker_id,
            free_blocks=int(load.get("free_blocks", 0)),
            total_blocks=int(load.get("total_blocks", 0)),
            lent={k: int(v) for k, v in load.get("lent_blocks", {}).items() if int(v)},
            borrowed={k: int(v) for k, v in load.get("borrowed_blocks", {}).items() if int(v)},
            lend_cap_blocks=None if cap is None else int(cap),
        )

    @property
    def lent_total(self) -> int:
        return sum(self.lent.values())


@dataclass(frozen=True)
class LedgerSnapshot:
    """Every live worker's block report, read at one moment."""

    at: float
    reports: tuple[BlockReport, ...]


@dataclass(frozen=True)
class LeaderTerm:
    """A kv_manager became the leader: the term is the fencing token its writes carry (the
    etcd revision at which it took the leader key, so later terms are larger)."""

    term: int
    leader: str
    """Instance id of the kv_manager that took the key."""
    started_at: float


@dataclass(frozen=True)
class LeaderWrite:
    """A write a kv_manager leader sent (a DGFM recall, a refusal mark...), as its target saw it."""

    at: float
    writer: str
    """Instance id of the kv_manager that sent it."""
    term: int
    """The term the write carried."""
    accepted: bool
    """False: the target refused it as fenced (its term was older than one it had seen)."""
    what: str = ""


@dataclass(frozen=True)
class Heal:
    """One fault healed, and when each service answered as serving again."""

    fault: str
    """The fault's id and kind, as the schedule names it."""
    healed_at: float
    serving_at: Mapping[str, float | None]
    """service (or pod) -> first moment it served again after ``healed_at`` (a moment before it:
    it never stopped); None: it had not served again by the end of the run."""
