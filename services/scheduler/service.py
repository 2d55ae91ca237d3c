"""The scheduler as a runtime :class:`~services.runtime.rpc.server.Service`.

``start()`` follows two etcd watches — gpu_worker members and load reports — into the
:class:`~services.scheduler.cluster_view.ClusterView` and returns once both have delivered their
first listing, so a ready scheduler always places on the workers that are live at that moment.
"""

from __future__ import annotations

import asyncio
import logging

from grpc import aio

from mesh_api.v1 import scheduler_pb2_grpc
from services.runtime.errors import Unavailable
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.etcd.leader_election import LeaderElection
from services.runtime.etcd.membership import follow, listed_within, watch_loads, watch_members
from services.runtime.process.tasks import cancel_and_wait
from services.scheduler.admission import AdmissionConfig, AdmissionControl
from services.scheduler.cluster_view import ClusterView
from services.scheduler.config import SchedulerConfig
from services.scheduler.live_prediction import make_length_predictions, prediction_report
from services.scheduler.placement import WaitModel
from services.scheduler.policies import make_migration, make_placement, make_prefetch, uses_prefix_index
from services.scheduler.policies.prefix_aware import PrefixAwareConfig
from services.scheduler.prefix_index import PrefixIndex, PrefixIndexConfig
from services.scheduler.rebalancing import DemandWindow, Rebalancer
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.worker_control import GrpcWorkerControl

log = logging.getLogger("loramesh.scheduler")

WORKER_SERVICE = "gpu_worker"
"""Member service name whose instances the scheduler places on."""
REBALANCER_ELECTION = "scheduler-rebalancer"
"""Election (``/loramesh/leader/scheduler-rebalancer``) of the replica that runs migration and
prefetch rounds; every replica places requests."""


class SchedulerService:
    name = "scheduler"
    grpc_service_name = "loramesh.v1.Scheduler"

    def __init__(self, config: SchedulerConfig):
        config.instance_id = config.resolved_instance_id(self.name)  # its rebalancing candidacy
        self.config = config
        model = WaitModel(
            adapter_load_ms=config.adapter_load_ms,
            per_request_step_ms=config.per_request_step_ms,
            mean_output_tokens=config.mean_output_tokens,
            min_tokens_per_s=config.min_tokens_per_s,
            default_service_ms=config.default_service_ms,
            max_running_hint=config.max_running_hint,
        )
        self.policy = make_placement(
            config.placement,
            model,
            PrefixAwareConfig(
                prefill_ms_per_token=config.prefix_prefill_ms_per_token,
                imbalance_ms_per_request=config.prefix_imbalance_ms_per_request,
            ),
        )
        index = PrefixIndexConfig(config.prefix_index_blocks, config.prefix_index_ttl_s)
        self.view = ClusterView(prefix_index=PrefixIndex(index) if uses_prefix_index(self.policy) else None)
        self.channels = ChannelPool(config.tls())
        self.rebalancer = Rebalancer(
            GrpcWorkerControl(self.channels, config.worker_call_deadline_s),
            make_migration(config.migration),
            make_prefetch(config.prefetch),
            DemandWindow(config.demand_window_s),
        )
        self.admission = AdmissionControl(
            AdmissionConfig(
                max_queue_per_worker=config.max_queue_per_worker,
                default_deadline_ms=config.default_deadline_ms,
            ),
            model,
        )
        self.predictions = make_length_predictions(
            config.length_predictor, config.predictor_bootstrap_completions
        )
        self.servicer = SchedulerServicer(
            self.view, self.policy, self.admission, self.rebalancer, self.predictions
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.election: LeaderElection | None = None
        """With --migration or --prefetch: the replicas' election of the one that rebalances."""

    def add_to_server(self, server: aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        cfg = self.config
        membership = cfg.required_membership(
            self.name, "it places requests on the gpu_workers it finds registered there"
        )
        members_listed, loads_listed = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(
                follow(
                    watch_members(membership, WORKER_SERVICE),
                    lambda members: self.view.update_members({k: m.address for k, m in members.items()}),
                    members_listed,
                ),
                name="scheduler:watch-members",
            ),
            loop.create_task(
                follow(watch_loads(membership), self.view.update_loads, loads_listed),
                name="scheduler:watch-loads",
            ),
        ]
        try:
            await listed_within(
                membership, cfg.start_timeout_s, "the workers", members_listed.wait(), loads_listed.wait()
            )
        except Unavailable:
            await self.stop()
            raise
        log.info("following %d gpu_worker(s) from etcd at %s", len(self.view), cfg.etcd_endpoints)
        rebalancer = self.rebalancer
        if rebalancer.migration is None and rebalancer.prefetch is None:
            return
        # Replicas would plan on the same workers and move the same requests: one leads.
        self.election = LeaderElection(membership, REBALANCER_ELECTION, cfg.instance_id)
        await self.election.start()
        if rebalancer.migration is not None:
            migration = rebalancer.migration
            self._tasks.append(
                loop.create_task(
                    self._every(migration.interval_s, rebalancer.migration_round), name="scheduler:migration"
                )
            )
        if rebalancer.prefetch is not None:
            prefetch = rebalancer.prefetch
            self._tasks.append(
                loop.create_task(
                    self._every(lambda: prefetch.interval_s, rebalancer.prefetch_round),
                    name="scheduler:prefetch",
                )
            )

    async def _every(self, interval_s, round_) -> None:
        """Run a rebalancing round, then wait the policy's interval (PetS adapts it), until stopped."""
        while True:
            await asyncio.sleep(interval_s())
            if not len(self.view) or not self.election.is_leader:
                continue
            try:
                await round_(self.view.snapshot())
            except Exception:  # a bug in one round must not end rebalancing
                log.exception("rebalancing round failed")

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        if self.election is not None:
            await self.election.stop()
        await self.channels.close()

    def load_report(self) -> dict:
        done = self.rebalancer.activity
        return {
            "workers": len(self.view),
            "placements": self.view.placements_total,
            "migrations": done.migrations,
            "migration_failures": done.migration_failures,
            "prefetches": done.prefetches,
            "prefetch_failures": done.prefetch_failures,
            "rebalance_rounds": done.rounds,
            "rebalance_leader": int(self.election is not None and self.election.is_leader),
            "prefix_index_blocks": 0 if self.view.prefix_index is None else self.view.prefix_index.size(),
            "prefix_hit_placements": self.view.prefix_hit_placements,
            "prefix_hit_tokens": self.view.prefix_hit_tokens,
            **({} if self.predictions is None else prediction_report(self.predictions)),
        }
