"""The kv_manager's write path to the workers (GrpcRecallWorkers) checks its leadership in a real
etcd before each call (issue 49): a leader whose key went behind its back sends nothing and steps
down. Its channels ping as the service channels do."""

from __future__ import annotations

import pytest
from support.held_election import HeldRounds, revoke_key_lease

from services.kv_manager import worker_recalls
from services.kv_manager.worker_recalls import GrpcRecallWorkers
from services.runtime.errors import Unavailable
from services.runtime.etcd.leader_election import LeaderElection
from services.runtime.rpc import keepalive
from services.runtime.security.tls import aio_channel


class _Term:
    """A tenure that leads under term 1 (no etcd: the channel is what is checked)."""

    instance_id = "kv-a"

    async def confirm(self) -> int:
        return 1

    def step_down(self, term: int, why: str) -> None:
        raise AssertionError(f"stepped down: {why}")


async def test_the_channel_to_a_worker_pings_as_the_service_channels_do(monkeypatch):
    opened = []

    def record(address, tls, options=()):
        opened.append(dict(options))
        return aio_channel(address, tls, options)

    monkeypatch.setattr(worker_recalls, "aio_channel", record)
    workers = GrpcRecallWorkers({"w0": "127.0.0.1:9"}, _Term(), 5.0)  # nothing listens there
    try:
        with pytest.raises(Unavailable):
            await workers.recall("w0", "w1", 1)
    finally:
        await workers.close()
    assert opened[0].items() >= dict(keepalive.CHANNEL_OPTIONS).items()
    assert opened[0]["grpc.keepalive_time_ms"] == keepalive.PING_EVERY_S * 1000
    assert opened[0]["grpc.keepalive_timeout_ms"] == keepalive.PING_TIMEOUT_S * 1000


@pytest.mark.integration
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
