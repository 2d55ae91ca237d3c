"""The kv_manager's write path to the workers (GrpcRecallWorkers) checks its leadership in a real
etcd before each call (issue 49): a leader whose key went behind its back sends nothing and steps
down."""

from __future__ import annotations

import pytest
from support.held_election import HeldRounds, revoke_key_lease

from services.kv_manager.worker_recalls import GrpcRecallWorkers
from services.runtime.errors import Unavailable
from services.runtime.etcd.leader_election import LeaderElection

pytestmark = pytest.mark.integration


async def test_a_leader_whose_key_moved_sends_nothing_and_steps_down(membership_config, etcd):
    a = LeaderElection(membership_config, "kv_manager", "kv-a", sleep=HeldRounds())
    b = LeaderElection(membership_config, "kv_manager", "kv-b")
    # Nothing listens there: a call that were sent would fail UNAVAILABLE naming the worker.
    workers = GrpcRecallWorkers({"w0": "127.0.0.1:9"}, a, 60.0)
    try:
        await a.start()
        await a.wait_decided()
        await revoke_key_lease(etcd.endpoint, a.key)
        await b.start()
        await b.wait_decided()
        assert a.is_leader and b.is_leader  # kv-a's rounds are held: it still thinks it leads
        with pytest.raises(Unavailable) as refused:
            await workers.recall("w0", "w1", 1)
        assert refused.value.message == "RecallBlocks to worker w0 not sent: kv_manager kv-a no longer leads"
        assert not a.is_leader and a.term == 0
    finally:
        await workers.close()
        await a.stop()
        await b.stop()
