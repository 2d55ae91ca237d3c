"""``SuggestCreditors``: up to three workers a debtor may ask to lend it KV blocks (seed 003
§4.4: "lowest relative communication cost, largest free memory").

The suggestion only advises: the debtor negotiates with each candidate in turn and asks again
when all refuse. Ranking: workers sharing the debtor's topology label first (cheapest to reach),
then the most lendable blocks, then worker id (so equal answers are stable).

As in the paper, the gManager sorts its instances by free memory periodically rather than per
query: :class:`CreditorIndex` keeps an order, rebuilt at most every ``resort_interval_s`` when
the ledger has changed, from which full workers are left out. A query walks that order and
re-checks each worker against the ledger as it is now, so a worker that filled up, refused or
left since the sort is skipped: a suggestion never names a full worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.kv_manager.ledger import DebtLedger
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted


@dataclass(frozen=True)
class CreditorConfig:
    """How creditors are suggested."""

    max_candidates: int = 3
    """Most candidates one suggestion names (the paper's three)."""
    resort_interval_s: float = 0.1
    """Shortest time between two sorts of the workers by lendable blocks."""
    retry_after_s: float = 1.0
    """Hint sent with RESOURCE_EXHAUSTED when no worker can lend (about one heartbeat)."""

    def __post_init__(self) -> None:
        if self.max_candidates < 1:
            raise ValueError(f"CreditorConfig.max_candidates must be >= 1, got {self.max_candidates}")
        if self.resort_interval_s < 0:
            raise ValueError(f"CreditorConfig.resort_interval_s must be >= 0, got {self.resort_interval_s}")


@dataclass(frozen=True)
class CreditorCandidate:
    """One worker a debtor may ask for blocks."""

    worker_id: str
    """Instance id of the creditor."""
    address: str
    """Its gRPC ``host:port``."""
    lendable_blocks: int
    """Blocks it could lend as of the ledger (may be fewer than asked: the debtor may combine)."""
    topology: str
    """Its topology label."""
    same_topology: bool
    """It shares the debtor's topology label."""


class CreditorIndex:
    """Workers sorted by lendable blocks, re-sorted periodically; answers suggestions."""

    def __init__(self, config: CreditorConfig | None = None):
        self.config = config or CreditorConfig()
        self._order: tuple[str, ...] = ()
        self._sorted_version = -1
        self._sorted_at = float("-inf")
        self.sorts = 0
        """How many times the workers were sorted."""

    def resort(self, ledger: DebtLedger, now: float) -> None:
        """Sort the workers with blocks to lend, most first (full ones are left out)."""
        lendable = {row.worker_id: ledger.lendable(row.worker_id) for row in ledger.rows()}
        self._order = tuple(
            sorted((w for w, n in lendable.items() if n > 0), key=lambda w: (-lendable[w], w))
        )
        self._sorted_version = ledger.version
        self._sorted_at = now
        self.sorts += 1

    def _maybe_resort(self, ledger: DebtLedger, now: float) -> None:
        if ledger.version == self._sorted_version:
            return
        if now - self._sorted_at >= self.config.resort_interval_s:
            self.resort(ledger, now)

    def suggest(self, ledger: DebtLedger, debtor_id: str, blocks: int, now: float) -> list[CreditorCandidate]:
        """Up to ``max_candidates`` creditors for ``blocks`` blocks of ``debtor_id``, best first.

        Raises InvalidArgument (no debtor, ``blocks`` < 1), NotFound (the debtor has no row in
        the ledger: it is not a live worker), FailedPrecondition (``blocks`` is more than every
        other worker together would ever lend, every live worker having reported: waiting cannot
        help) and ResourceExhausted (no other worker can lend now).
        """
        if not debtor_id:
            raise InvalidArgument("SuggestCreditors needs debtor_id: the worker that wants to borrow")
        if blocks < 1:
            raise InvalidArgument(f"SuggestCreditors needs blocks >= 1, got {blocks}")
        debtor = ledger.row(debtor_id)
        if debtor is None:
            raise NotFound(
                f"debtor {debtor_id!r} is not in the ledger: no live gpu_worker with a load report has that id"
            )
        ceiling = sum(row.lend_ceiling for row in ledger.rows() if row.worker_id != debtor_id)
        if blocks > ceiling and not ledger.unreported - {debtor_id}:  # every lender's cap known
            raise FailedPrecondition(
                f"{debtor_id!r} needs {blocks} KV blocks more than its pool; the other workers lend "
                f"at most {ceiling} together (their lend caps): more workers, larger pools or larger "
                "--lend-cap-blocks would serve it"
            )
        self._maybe_resort(ledger, now)
        local: list[CreditorCandidate] = []
        remote: list[CreditorCandidate] = []
        wanted = self.config.max_candidates
        for worker_id in self._order:
            if len(local) >= wanted:
                break
            lendable = ledger.lendable(worker_id)
            row = ledger.row(worker_id)
            if worker_id == debtor_id or row is None or lendable < 1:
                continue
            same = row.topology == debtor.topology
            group = local if same else remote
            if len(group) < wanted:
                group.append(CreditorCandidate(worker_id, row.address, lendable, row.topology, same))
        # The sort may be older than the ledger: order by what the ledger says now.
        local.sort(key=lambda c: (-c.lendable_blocks, c.worker_id))
        remote.sort(key=lambda c: (-c.lendable_blocks, c.worker_id))
        candidates = (local + remote)[:wanted]
        if not candidates:
            raise ResourceExhausted(
                f"no worker other than {debtor_id!r} has KV blocks to lend", self.config.retry_after_s
            )
        return candidates
