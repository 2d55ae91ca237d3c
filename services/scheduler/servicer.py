"""``loramesh.v1.Scheduler``: proto <-> the placement, rebalancing and length-prediction domain.

Placing is a few dict lookups and a sort over the workers, on the event loop; what costs more
runs elsewhere: a prompt's embedding for the length predictor on a thread, a migration's worker
calls awaited (``rebalancing.py``).
"""

from __future__ import annotations

import asyncio
import logging

from mesh_api.v1 import scheduler_pb2 as pb
from mesh_api.v1 import scheduler_pb2_grpc
from services.runtime.errors import InvalidArgument
from services.runtime.field_copy import dataclass_of, message_of
from services.scheduler.admission import AdmissionControl
from services.scheduler.cluster_view import ClusterSnapshot, ClusterView
from services.scheduler.live_prediction import LivePredictions
from services.scheduler.placement import PlacementDecision, PlacementRequest
from services.scheduler.policies.interface import PlacementPolicy
from services.scheduler.rebalancing import Rebalancer

log = logging.getLogger("loramesh.scheduler")


def request_from_proto(request: pb.PlaceRequest) -> PlacementRequest:
    return dataclass_of(
        PlacementRequest,
        request,
        exclude_workers=frozenset(request.exclude_workers),
        prefix_blocks=tuple(request.prefix_blocks),
    )


def placement_to_proto(placement: PlacementDecision) -> pb.PlaceResponse:
    return message_of(pb.PlaceResponse, placement)


def snapshot_to_proto(snapshot: ClusterSnapshot, activity: pb.SchedulerActivity) -> pb.ClusterViewResponse:
    return pb.ClusterViewResponse(
        activity=activity,
        workers=[
            message_of(
                pb.WorkerView,
                w,
                resident_adapters=sorted(w.resident_adapters),
                placed_since_report=snapshot.placed(w.worker_id),
                report_age_ms=max(0.0, (snapshot.taken_at - w.report_ts) * 1000) if w.report_ts else 0.0,
            )
            for w in snapshot.workers
        ],
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Places requests over the view the service keeps up to date from etcd."""

    def __init__(
        self,
        view: ClusterView,
        policy: PlacementPolicy,
        admission: AdmissionControl,
        rebalancer: Rebalancer,
        predictions: LivePredictions | None = None,
    ):
        self.view = view
        self.policy = policy
        self.admission = admission
        self.rebalancer = rebalancer
        self.predictions = predictions

    async def Place(self, request: pb.PlaceRequest, context) -> pb.PlaceResponse:
        wanted = request_from_proto(request)
        snapshot = self.view.snapshot_for(
            wanted.prefix_blocks, wanted.prefix_block_tokens, wanted.prompt_tokens
        )
        predicted = 0
        if self.predictions is not None:
            if request.prompt_text:  # a first placement (resumes and migrations carry none)
                predicted = await asyncio.to_thread(
                    self.predictions.predict,
                    request.request_id,
                    request.prompt_text,
                    request.prompt_tokens,
                    request.adapter_id,
                )
            snapshot = snapshot.with_predicted_lengths(self.predictions.outstanding_means())
        placement = self.admission.place(self.policy, snapshot, wanted)
        self.view.record_placement(
            placement.worker_id, wanted.adapter_id, wanted.prefix_blocks, placement.cached_prefix_tokens
        )
        self.rebalancer.demand.record(placement.worker_id, wanted.adapter_id)
        if self.predictions is not None:
            self.predictions.placed(request.request_id, placement.worker_id)
        log.debug(
            "placed %s (adapter %r) on %s: wait %.1f ms, resident %s, cached prefix ~%d tokens",
            wanted.request_id, wanted.adapter_id, placement.worker_id,
            placement.estimated_wait_ms, placement.adapter_resident, placement.cached_prefix_tokens,
        )  # fmt: skip
        reply = placement_to_proto(placement)
        reply.predicted_output_tokens = predicted
        return reply

    async def ReportCompletion(
        self, request: pb.ReportCompletionRequest, context
    ) -> pb.ReportCompletionResponse:
        if self.predictions is not None:
            self.predictions.observe(request.request_id, request.generated_tokens)
        return pb.ReportCompletionResponse()

    async def ClusterView(self, request: pb.ClusterViewRequest, context) -> pb.ClusterViewResponse:
        return snapshot_to_proto(self.view.snapshot(), self.activity())

    def activity(self) -> pb.SchedulerActivity:
        rebalancer = self.rebalancer
        done = rebalancer.activity
        return pb.SchedulerActivity(
            migration_policy=rebalancer.migration.name if rebalancer.migration else "none",
            prefetch_policy=rebalancer.prefetch.name if rebalancer.prefetch else "none",
            migrations=done.migrations,
            migration_failures=done.migration_failures,
            prefetches=done.prefetches,
            prefetch_failures=done.prefetch_failures,
            rebalance_rounds=done.rounds,
            **self._predictor_activity(),
        )

    def _predictor_activity(self) -> dict:
        if self.predictions is None:
            return {"length_predictor": "none"}
        stats = self.predictions.stats()
        return {
            "length_predictor": self.predictions.name,
            "predictions": stats["predictions"],
            "completions_observed": stats["observed"],
            "predictor_mae_tokens": stats["mean_abs_error_tokens"],
            "predictor_refits": stats["retrains"],
        }

    async def Migrate(self, request: pb.MigrateRequest, context) -> pb.MigrateResponse:
        if not request.request_id:
            raise InvalidArgument("request_id is empty: name the request to migrate")
        snapshot = self.view.snapshot()

        def least_wait_elsewhere(adapter_id: str, source: str) -> str:
            wanted = PlacementRequest(adapter_id=adapter_id, exclude_workers=frozenset({source}))
            return self.policy.place(snapshot, wanted).worker_id

        move, generated = await self.rebalancer.migrate(
            snapshot, request.request_id, request.target_worker_id, least_wait_elsewhere
        )
        log.info(
            "migrated %s from %s to %s after %d tokens (asked for %s)",
            move.request_id, move.source, move.target, generated, request.request_id,
        )  # fmt: skip
        return pb.MigrateResponse(
            source_worker_id=move.source, target_worker_id=move.target, worker_request_id=move.request_id
        )
