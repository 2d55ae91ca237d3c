"""The kv_manager as a runtime :class:`~services.runtime.rpc.server.Service`.

``start()`` follows three etcd watches -- gpu_worker members, load reports (the workers'
``WorkerLoad`` heartbeats) and the kv_manager replicas -- and campaigns for leadership of
``/loramesh/leader/kv_manager``. It returns once the workers are listed and the election has
told who leads, so a ready replica always answers from a fed ledger.

Every replica keeps its own ledger from the same heartbeats (a standby can take over at once),
but only the leader suggests creditors, records refusals and plans DGFM: the refusal marks, the
periodic sort and the freezes of a plan must live in one place. The leader also has the workers
apply DGFM plans (:class:`~services.kv_manager.defragmenter.Defragmenter`), every
``dgfm_interval_s`` and on ``Defragment``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from grpc import aio

from mesh_api.v1 import kv_manager_pb2_grpc
from services.kv_manager.config import KVManagerConfig
from services.kv_manager.creditors import CreditorConfig, CreditorIndex
from services.kv_manager.defragmenter import Defragmenter
from services.kv_manager.dgfm import DgfmConfig
from services.kv_manager.heartbeats import ledger_rows
from services.kv_manager.ledger import DebtLedger
from services.kv_manager.prefix_index import PrefixIndex
from services.kv_manager.servicer import KVManagerServicer
from services.kv_manager.worker_recalls import GrpcRecallWorkers
from services.runtime.errors import Unavailable
from services.runtime.etcd.leader_election import LeaderElection
from services.runtime.etcd.membership import MemberInfo, follow, listed_within, watch_loads, watch_members
from services.runtime.process.tasks import cancel_and_wait

log = logging.getLogger("loramesh.kv_manager")

WORKER_SERVICE = "gpu_worker"
"""Member service name whose instances lend and borrow KV blocks."""


class KVManagerService:
    name = "kv_manager"
    grpc_service_name = "loramesh.v1.KVManager"

    def __init__(self, config: KVManagerConfig):
        # The leader key names the instance id the host registers the member under: pin it now.
        config.instance_id = config.resolved_instance_id(self.name)
        self.config = config
        self.ledger = DebtLedger()
        self.index = CreditorIndex(
            CreditorConfig(
                max_candidates=config.max_candidates,
                resort_interval_s=config.resort_interval_s,
                retry_after_s=config.retry_after_s,
            )
        )
        self.election: LeaderElection | None = None
        dgfm = DgfmConfig(min_swap_blocks=config.min_swap_blocks)
        # Runs happen only while this replica leads, so after start() made the election.
        self.defragmenter = Defragmenter(
            dgfm,
            lambda addresses: GrpcRecallWorkers(
                addresses, self.election, config.dgfm_call_timeout_s, config.tls()
            ),
        )
        self.servicer = KVManagerServicer(
            self.ledger,
            self.index,
            dgfm,
            self.defragmenter,
            config.instance_id,
            leader=lambda: (self.election.leader_id, self.election.leader_term) if self.election else ("", 0),
            require_leader=self.require_leader,
            prefix_index=PrefixIndex(),
            worker_address=lambda worker_id: self._addresses.get(worker_id),
        )
        self._addresses: dict[str, str] = {}
        self._started: dict[str, float] = {}
        """Live workers' process start times: a worker registered again holds none of the
        prefix blocks its predecessor announced."""
        self._reports: Mapping[str, Mapping[str, Any]] = {}
        self._replicas: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add_to_server(self, server: aio.Server) -> None:
        kv_manager_pb2_grpc.add_KVManagerServicer_to_server(self.servicer, server)

    def require_leader(self, what: str) -> None:
        """Raise UNAVAILABLE naming the leader unless this replica leads."""
        me = self.config.instance_id
        leader = self.election.leader_id if self.election else ""
        if leader == me:
            return
        if not leader:
            raise Unavailable(
                f"{what}: no kv_manager leader is known yet (replica {me} is campaigning); retry"
            )
        where = self._replicas.get(leader, "an address not yet listed in etcd")
        raise Unavailable(f"{what}: kv_manager {me} is a standby; the leader is {leader} at {where}")

    async def start(self) -> None:
        cfg = self.config
        membership = cfg.required_membership(
            self.name,
            "its ledger is fed by the gpu_workers' heartbeats there and its replicas elect a leader there",
        )
        self.election = LeaderElection(membership, self.name, cfg.instance_id)
        workers_listed, loads_listed = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(
                follow(watch_members(membership, WORKER_SERVICE), self._set_workers, workers_listed),
                name="kv_manager:watch-workers",
            ),
            loop.create_task(
                follow(watch_loads(membership), self._set_reports, loads_listed),
                name="kv_manager:watch-loads",
            ),
            loop.create_task(
                follow(watch_members(membership, self.name), self._set_replicas),
                name="kv_manager:watch-replicas",
            ),
        ]
        if cfg.dgfm_interval_s > 0:
            self._tasks.append(
                loop.create_task(
                    self.defragmenter.run_periodically(
                        self.ledger, cfg.dgfm_interval_s, lambda: self.election.is_leader
                    ),
                    name="kv_manager:dgfm",
                )
            )
        await self.election.start()
        try:
            await listed_within(
                membership,
                cfg.start_timeout_s,
                "the workers and the leader",
                workers_listed.wait(),
                loads_listed.wait(),
                self.election.wait_decided(),
            )
        except Unavailable:
            await self.stop()
            raise
        log.info(
            "following %d gpu_worker(s) from etcd at %s; leader %s",
            len(self.ledger), cfg.etcd_endpoints, self.election.leader_id,
        )  # fmt: skip

    def _set_workers(self, members: Mapping[str, MemberInfo]) -> None:
        self._addresses = {worker_id: m.address for worker_id, m in members.items()}
        started = {worker_id: m.started_at for worker_id, m in members.items()}
        for worker_id, at in self._started.items():
            if started.get(worker_id) != at:
                self.servicer.prefix_index.forget(worker_id)
        self._started = started
        self.servicer.prefix_index.retain(started)
        self._replace_rows()

    def _set_reports(self, reports: Mapping[str, Mapping[str, Any]]) -> None:
        self._reports = reports
        self._replace_rows()

    def _replace_rows(self) -> None:
        rows = ledger_rows(self._addresses, self._reports)
        self.ledger.replace(rows, unreported=self._addresses.keys() - {row.worker_id for row in rows})

    def _set_replicas(self, members: Mapping[str, MemberInfo]) -> None:
        self._replicas = {instance_id: m.address for instance_id, m in members.items()}

    async def stop(self) -> None:
        # Leadership first: a standby takes over while this one drains its watches.
        if self.election is not None:
            await self.election.stop()
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    def load_report(self) -> dict:
        rows = self.ledger.rows()
        return {
            "workers": len(rows),
            "leader": int(self.election is not None and self.election.is_leader),
            "term": self.election.term if self.election is not None else 0,
            "free_blocks": sum(row.free_blocks for row in rows),
            "lent_blocks": sum(row.lent_total for row in rows),
            "suggestions": self.servicer.suggestions,
            "dgfm_swaps_planned": self.servicer.swaps_planned,
            "dgfm_swaps_total": self.defragmenter.swaps_total,
            "dgfm_blocks_moved_total": self.defragmenter.blocks_moved_total,
            "dgfm_runs_failed_total": self.defragmenter.runs_failed,
            "prefix_index_blocks": len(self.servicer.prefix_index),
        }
