"""Two scheduler replicas with ``--migration``: both place requests, only the elected one runs
migration rounds (two would plan on the same workers and move the same requests). Real etcd,
the schedulers in this process; the workers are etcd registrations that answer no RPC, so each
round lists nobody and plans nothing, but it is counted."""

from __future__ import annotations

import asyncio

from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService

HANG_GUARD_S = 120.0  # not a timing claim: only keeps a broken build from hanging the suite


async def test_only_the_elected_replica_runs_migration_rounds(etcd):
    worker = MemberRegistration(
        MembershipConfig(etcd_endpoints=etcd.endpoint, ttl_s=5),
        MemberInfo.create("gpu_worker", "127.0.0.1:1", instance_id="w1"),
        load_fn=lambda: {"queue": 0, "running": 0},
    )
    await worker.start()
    replicas = [
        SchedulerService(
            SchedulerConfig(
                etcd_endpoints=etcd.endpoint, migration="co-migration", instance_id=f"scheduler-{i}"
            )
        )
        for i in range(2)
    ]
    try:
        for replica in replicas:
            await replica.start()
            await replica.election.wait_decided()

        async def rounds_run() -> None:
            while sum(r.rebalancer.activity.rounds for r in replicas) < 3:
                await asyncio.sleep(0.1)

        await asyncio.wait_for(rounds_run(), HANG_GUARD_S)
        leaders = [r for r in replicas if r.election.terms > 0]
        assert len(leaders) == 1, "leadership changed hands during the test"
        (follower,) = [r for r in replicas if r is not leaders[0]]
        assert follower.rebalancer.activity.rounds == 0
        assert follower.load_report()["rebalance_leader"] == 0
        assert leaders[0].load_report()["rebalance_leader"] == 1
    finally:
        for replica in replicas:
            await replica.stop()
        await worker.stop()
