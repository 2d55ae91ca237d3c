"""Fencing the kv_manager leader's writes by term (issue 49).

Two kv_managers can each believe they lead for a while (a partition, a paused process): the
leader key in etcd has moved and the old leader has not heard yet. Each write a leader sends a
worker (DGFM's recalls and stages) names its term, the etcd create revision of the leader key
when it took it, so a later leader's term is larger. The worker takes writes under the newest
term it has seen and refuses older ones: once the new leader has written here, nothing the
deposed one sends lands after it, and the refusal tells the deposed one to step down.

A write without a term is refused too. Only a kv_manager from before fencing sends one, and it
cannot be told from a deposed leader's; DGFM only restores locality, so a mesh upgraded worker
first just goes without it until its kv_manager is upgraded too.

Every decision is counted (the load report's ``leader_writes_*``) and logged on one line a
runner can collect (docs/operations.md, "kv_manager leadership and fencing"). Calls come from the
event loop only. No gRPC here.
"""

from __future__ import annotations

import logging

from services.runtime.errors import FailedPrecondition, InvalidArgument, StaleLeaderTerm

log = logging.getLogger("loramesh.leader_fence")


class LeaderFence:
    """The newest kv_manager leader term this worker has taken writes under."""

    def __init__(self) -> None:
        self.term = 0
        """Newest term taken (0: no leader has written here yet)."""
        self.leader = ""
        """Instance id of the kv_manager that holds it."""
        self.accepted = 0
        """Writes taken."""
        self.refused = 0
        """Writes refused as a deposed leader's (or one without a term, or a term not theirs)."""

    def admit(self, term: int, leader: str, what: str) -> None:
        """Take write ``what`` from kv_manager ``leader`` under ``term``, or raise: StaleLeaderTerm
        for a term older than :attr:`term` (or none), FailedPrecondition for this term claimed
        by another kv_manager, InvalidArgument for a term that names no kv_manager."""
        if term and not leader:
            raise InvalidArgument(f"{what} under term {term} names no leader: set leader.leader_id")
        if term < self.term or not term:
            self._refuse(term, leader, what)
            stale = (
                f"under term {term}" if term else "without a leader term (a kv_manager from before fencing)"
            )
            raise StaleLeaderTerm(
                f"{what} from kv_manager {leader or '?'} {stale} refused: this worker has taken "
                f"term {self.term} (kv_manager {self.leader or '?'}); {leader or 'it'} is not the leader",
                self.term,
            )
        if term == self.term and leader != self.leader:
            self._refuse(term, leader, what)
            raise FailedPrecondition(
                f"{what} from kv_manager {leader} under term {term} refused: term {term} is "
                f"kv_manager {self.leader}'s (two kv_managers on different etcd clusters?)"
            )
        if term > self.term:
            log.info(
                "kv_manager leader term %d of %s replaces term %d of %s",
                term, leader, self.term, self.leader or "-",
            )  # fmt: skip
            self.term, self.leader = term, leader
        self.accepted += 1
        log.info("kv_manager write %s from %s term %d: accepted", what, leader, term)

    def _refuse(self, term: int, leader: str, what: str) -> None:
        self.refused += 1
        log.warning(
            "kv_manager write %s from %s term %d: refused (newest term %d of %s)",
            what, leader or "-", term, self.term, self.leader or "-",
        )  # fmt: skip
