"""Leader election on a real etcd: one leader among candidates, a clean stop hands over, a
leader that vanishes without a word is replaced once its lease expires."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.etcd.leader_election import LeaderElection

pytestmark = pytest.mark.integration


@pytest.fixture
async def candidates(membership_config):
    started: list[LeaderElection] = []

    async def start(instance_id: str) -> LeaderElection:
        election = LeaderElection(membership_config, "kv_manager", instance_id)
        await election.start()
        started.append(election)
        await election.wait_decided()
        return election

    yield start
    for election in started:
        await election.stop()


async def test_one_leader_and_a_clean_stop_hands_over(candidates, poll):
    a = await candidates("kv-a")
    b = await candidates("kv-b")
    assert a.is_leader and not b.is_leader
    assert a.key == "/loramesh/leader/kv_manager" and b.leader_id == "kv-a" and a.terms == 1
    await a.stop()
    assert a.leader_id == ""
    await poll(lambda: asyncio.sleep(0, b), lambda e: e.is_leader, "b leads after a stopped")
    assert b.terms == 1


async def test_a_leader_that_vanishes_is_replaced_when_its_lease_expires(candidates, poll):
    a = await candidates("kv-a")
    b = await candidates("kv-b")
    assert a.is_leader
    await a.abandon()  # as if the process had crashed: no revoke, the key lives until its lease expires
    await poll(lambda: asyncio.sleep(0, b), lambda e: e.is_leader, "b leads after a's lease expired")


async def test_candidates_step_down_while_etcd_is_gone_and_elect_again(candidates, poll, etcd):
    a = await candidates("kv-a")
    etcd.stop()
    await poll(lambda: asyncio.sleep(0, a), lambda e: e.leader_id == "", "a steps down without etcd")
    etcd.start()
    await poll(lambda: asyncio.sleep(0, a), lambda e: e.is_leader, "a leads again")
