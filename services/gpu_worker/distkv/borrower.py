"""How the engine borrows KV blocks when its pool is full (DistKV-LLM §4.4): ask the gManager
for candidate creditors, negotiate with each directly, report refusals and ask again.

Pure domain: the gManager is a :class:`CreditorDirectory` (a gRPC client of the kv_manager in
the worker process, a fixed list in tests) and creditors are reached through the
``CreditorTransport`` that ``connect`` builds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.gpu_worker.distkv.block_table import RemoteBlock
from services.gpu_worker.distkv.remote_block_allocator import CreditorTransport
from services.gpu_worker.distkv.rmanager import RManager
from services.runtime.errors import DomainError, FailedPrecondition, ResourceExhausted, Unavailable

log = logging.getLogger("loramesh.engine")


@dataclass(frozen=True)
class Candidate:
    """A worker the gManager suggests borrowing from."""

    worker_id: str
    """Its instance id."""
    address: str
    """Its Worker gRPC ``host:port``."""
    lendable_blocks: int
    """Blocks it could lend as of its last heartbeat (it may refuse: the ledger is loose)."""


class CreditorDirectory(Protocol):
    """The gManager as the debtor's engine thread sees it (synchronous calls)."""

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        """Up to 3 candidates, best first; none when nobody can lend."""
        ...

    def report_refusal(self, debtor: str, creditor: str) -> None:
        """``creditor`` refused: do not suggest it again before its next heartbeat."""
        ...


TransportFactory = Callable[[str, str], CreditorTransport]
"""(creditor id, address) -> a transport to that creditor."""


class MeshCannotLend(ResourceExhausted):
    """More blocks are needed than every other worker together would ever lend (the gManager
    says so: FailedPrecondition): waiting for lenders cannot help."""


class Borrower:
    """Borrows blocks for ``rm``'s worker, from the creditors ``directory`` suggests."""

    def __init__(
        self, rm: RManager, directory: CreditorDirectory, connect: TransportFactory, max_rounds: int = 4
    ):
        """``max_rounds``: suggestions asked for at most per borrow before giving up."""
        self.rm = rm
        self.directory = directory
        self.connect = connect
        self.max_rounds = max_rounds
        self._transports: dict[str, CreditorTransport] = {}

    def borrow(self, count: int) -> list[RemoteBlock]:
        """``count`` blocks, from one or several creditors, all or none (``ResourceExhausted``)."""
        me = self.rm.worker_id
        borrowed: list[RemoteBlock] = []
        why = "no creditor was suggested"
        for _ in range(self.max_rounds):
            missing = count - len(borrowed)
            if missing == 0:
                return borrowed
            try:
                candidates = self.directory.suggest(me, missing)
            except FailedPrecondition as beyond_the_mesh:
                self.rm.free(borrowed)
                raise MeshCannotLend(beyond_the_mesh.message) from beyond_the_mesh
            except DomainError as no_lender:  # none can lend now, or no gManager to ask
                log.info("no creditor for %d blocks: %s", missing, no_lender)
                why = no_lender.message
                break
            for candidate in candidates:
                missing = count - len(borrowed)
                if missing == 0:
                    break
                ask = max(1, min(missing, candidate.lendable_blocks))
                self.rm.connect(candidate.worker_id, self._transport(candidate))
                try:
                    borrowed += self.rm.borrow(candidate.worker_id, ask)
                except (ResourceExhausted, Unavailable) as refused:
                    log.info("creditor %s refused %d blocks: %s", candidate.worker_id, ask, refused)
                    why = f"creditor {candidate.worker_id} refused {ask} blocks: {refused.message}"
                    self.directory.report_refusal(me, candidate.worker_id)
        if len(borrowed) == count:
            return borrowed
        self.rm.free(borrowed)
        raise ResourceExhausted(f"could borrow only {len(borrowed)} of {count} KV blocks: {why}")

    def refused(self, creditor: str) -> None:
        """``creditor`` refused to compute attention (its compute cap): the gManager is told, as
        for a refused loan, so it is not suggested again before its next heartbeat."""
        try:
            self.directory.report_refusal(self.rm.worker_id, creditor)
        except DomainError as unreported:  # no gManager to tell: the next borrow may ask it again
            log.info("could not report %s's refusal: %s", creditor, unreported)

    def _transport(self, candidate: Candidate) -> CreditorTransport:
        """One transport per creditor (instance ids are never reused, so neither are they)."""
        if candidate.worker_id not in self._transports:
            self._transports[candidate.worker_id] = self.connect(candidate.worker_id, candidate.address)
        return self._transports[candidate.worker_id]
