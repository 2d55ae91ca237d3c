"""``loramesh.v1.KVManager``: proto <-> ledger, creditor and DGFM domain, nothing more.

Every call is dict lookups and a sort or a DFS over at most a few hundred workers: it runs on
the event loop without blocking it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mesh_api.v1 import kv_manager_pb2 as pb
from mesh_api.v1 import kv_manager_pb2_grpc
from services.kv_manager.creditors import CreditorCandidate, CreditorIndex
from services.kv_manager.defragmenter import Defragmenter
from services.kv_manager.dgfm import DefragPlan, DgfmConfig, plan_defragmentation
from services.kv_manager.dgfm_execution import DefragOutcome
from services.kv_manager.ledger import DebtLedger
from services.kv_manager.prefix_index import PrefixIndex
from services.runtime.errors import InvalidArgument, NotFound
from services.runtime.field_copy import message_of
from services.runtime.security.acting_instance import acting_instance

log = logging.getLogger("loramesh.kv_manager")


def candidate_to_proto(candidate: CreditorCandidate) -> pb.CreditorCandidate:
    return message_of(pb.CreditorCandidate, candidate)


def ledger_to_proto(ledger: DebtLedger, now: float) -> list[pb.LedgerEntry]:
    return [
        message_of(
            pb.LedgerEntry,
            row,
            lent_blocks=dict(row.lent),
            lendable_blocks=ledger.lendable(row.worker_id),
            refused=ledger.refused(row.worker_id),
            report_age_ms=max(0.0, (now - row.reported_at) * 1000) if row.reported_at else 0.0,
        )
        for row in ledger.rows()
    ]


def plan_to_proto(plan: DefragPlan) -> pb.PlanDefragmentationResponse:
    swaps = [
        message_of(pb.CycleSwap, swap, recalls=[message_of(pb.BlockRecall, r) for r in swap.recalls])
        for swap in plan.swaps
    ]
    return message_of(
        pb.PlanDefragmentationResponse, plan, swaps=swaps, frozen_workers=sorted(plan.frozen_workers)
    )


def outcome_to_proto(outcome: DefragOutcome) -> pb.DefragmentResponse:
    reply = pb.DefragmentResponse(
        plan=plan_to_proto(outcome.plan), swaps_done=outcome.swaps_done, blocks_moved=outcome.blocks_moved
    )
    failure = outcome.failure
    if failure is not None:
        reply.failed_worker = failure.failed_step.owner_id
        reply.error_code = failure.error.code_name
        reply.error = failure.error.message
    return reply


class KVManagerServicer(kv_manager_pb2_grpc.KVManagerServicer):
    """Answers from the ledger the service keeps up to date from etcd.

    ``require_leader(what)`` raises when this replica is a standby (only the leader suggests,
    records refusals and plans); ``leader()`` names the leader and its term for the Ledger answer.
    """

    def __init__(
        self,
        ledger: DebtLedger,
        index: CreditorIndex,
        dgfm: DgfmConfig,
        defragmenter: Defragmenter,
        instance_id: str,
        leader: Callable[[], tuple[str, int]],
        require_leader: Callable[[str], None],
        clock: Callable[[], float] = time.time,
        prefix_index: PrefixIndex | None = None,
        worker_address: Callable[[str], str | None] = lambda worker_id: None,
    ):
        """``prefix_index``: the cluster prefix tier's index (None: a new empty one);
        ``worker_address``: a live gpu_worker's address by id (None: not a live worker)."""
        self.prefix_index = prefix_index or PrefixIndex()
        self.worker_address = worker_address
        self.ledger = ledger
        self.index = index
        self.dgfm = dgfm
        self.defragmenter = defragmenter
        self.instance_id = instance_id
        self.leader = leader
        self.require_leader = require_leader
        self.clock = clock
        self.suggestions = 0
        """SuggestCreditors answers given (with at least one candidate)."""
        self.swaps_planned = 0
        """DGFM cycle swaps planned over all PlanDefragmentation calls."""

    async def SuggestCreditors(
        self, request: pb.SuggestCreditorsRequest, context
    ) -> pb.SuggestCreditorsResponse:
        self.require_leader("SuggestCreditors")
        debtor = acting_instance(request.debtor_id, required=False)
        candidates = self.index.suggest(self.ledger, debtor, request.blocks, self.clock())
        self.suggestions += 1
        log.debug(
            "suggested %s to %s for %d blocks",
            [c.worker_id for c in candidates],
            debtor,
            request.blocks,
        )
        return pb.SuggestCreditorsResponse(candidates=[candidate_to_proto(c) for c in candidates])

    async def ReportRefusal(self, request: pb.ReportRefusalRequest, context) -> pb.ReportRefusalResponse:
        self.require_leader("ReportRefusal")
        if not request.creditor_id:
            raise InvalidArgument("ReportRefusal needs creditor_id: the worker that refused")
        debtor = acting_instance(request.debtor_id, required=False)
        if not self.ledger.mark_refused(request.creditor_id):
            raise NotFound(f"creditor {request.creditor_id!r} is not in the ledger")
        log.info("%s refused %r: not suggested until its next heartbeat", request.creditor_id, debtor)
        return pb.ReportRefusalResponse()

    async def Ledger(self, request: pb.LedgerRequest, context) -> pb.LedgerResponse:
        leader_id, leader_term = self.leader()
        return pb.LedgerResponse(
            workers=ledger_to_proto(self.ledger, self.clock()),
            instance_id=self.instance_id,
            leader_id=leader_id,
            leader_term=leader_term,
            dgfm_swaps_total=self.defragmenter.swaps_total,
            dgfm_blocks_moved_total=self.defragmenter.blocks_moved_total,
        )

    async def PlanDefragmentation(
        self, request: pb.PlanDefragmentationRequest, context
    ) -> pb.PlanDefragmentationResponse:
        self.require_leader("PlanDefragmentation")
        config = DgfmConfig(request.min_swap_blocks) if request.min_swap_blocks else self.dgfm
        plan = plan_defragmentation(self.ledger.debts(), config)
        self.swaps_planned += plan.swap_count
        if plan.swaps:
            log.info(
                "DGFM: %d swap(s), %d blocks moved, remote blocks %d -> %d",
                plan.swap_count, plan.blocks_moved, plan.remote_blocks_before, plan.remote_blocks_after,
            )  # fmt: skip
        return plan_to_proto(plan)

    async def Defragment(self, request: pb.DefragmentRequest, context) -> pb.DefragmentResponse:
        self.require_leader("Defragment")
        config = DgfmConfig(request.min_swap_blocks) if request.min_swap_blocks else None
        return outcome_to_proto(await self.defragmenter.run(self.ledger, config))

    async def AnnouncePrefixBlocks(
        self, request: pb.AnnouncePrefixBlocksRequest, context
    ) -> pb.AnnouncePrefixBlocksResponse:
        self.require_leader("AnnouncePrefixBlocks")
        worker = acting_instance(request.worker_id, "worker_id")
        if self.worker_address(worker) is None:
            # Its entries would outlive it: the membership watch forgets only workers it listed.
            raise NotFound(f"worker {worker!r} is not a live gpu_worker in etcd (yet)")
        held = self.prefix_index.announce(
            worker, request.kv_identity, request.added, request.removed, replace=request.replace
        )
        return pb.AnnouncePrefixBlocksResponse(index_id=self.index_id(), held_blocks=held)

    async def LocatePrefix(self, request: pb.LocatePrefixRequest, context) -> pb.LocatePrefixResponse:
        self.require_leader("LocatePrefix")
        asker = acting_instance(request.worker_id, "worker_id", required=False)
        holder = self.prefix_index.locate(asker, request.kv_identity, request.keys)
        address = self.worker_address(holder.worker_id) if holder.worker_id else None
        if address is None:  # gone since it announced: the watch forgets it at once
            return pb.LocatePrefixResponse(index_id=self.index_id())
        return pb.LocatePrefixResponse(
            holder_id=holder.worker_id, address=address, blocks=holder.blocks, index_id=self.index_id()
        )

    def index_id(self) -> str:
        """This index's incarnation: a new leader (or term) starts empty, so workers that see
        another id announce their whole set again."""
        _, term = self.leader()
        return f"{self.instance_id}/{term}"
