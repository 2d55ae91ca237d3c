"""Leader election on a real etcd: one leader among candidates, a clean stop hands over, a
leader that vanishes without a word is replaced once its lease expires; its term (issue 49) is
the key's create revision, kept while it leads, larger for each later leader; a leader that steps
down or fails to confirm its key leads again only under a newer term."""

from __future__ import annotations

import asyncio

import pytest
from support.etcd_lease import key_lease, lease_alive
from support.held_election import HeldRounds, create_revision, revoke_key_lease

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


class CountedRounds:
    """The wait between rounds, counted: a test waits for rounds, not for time."""

    def __init__(self) -> None:
        self.rounds = 0

    async def __call__(self, seconds: float) -> None:
        self.rounds += 1
        await asyncio.sleep(seconds)


async def test_the_term_is_the_keys_create_revision_kept_while_it_leads_and_larger_after(
    membership_config, etcd, poll
):
    counted = CountedRounds()
    a = LeaderElection(membership_config, "kv_manager", "kv-a", sleep=counted)
    b = LeaderElection(membership_config, "kv_manager", "kv-b")
    try:
        await a.start()
        await a.wait_decided()
        term = a.term
        assert term == await create_revision(etcd.endpoint, a.key) > 0
        await poll(lambda: asyncio.sleep(0, counted), lambda c: c.rounds >= 3, "three more rounds")
        assert (a.term, a.terms, await a.confirm()) == (term, 1, term)  # refreshes keep the term
        await b.start()
        await b.wait_decided()
        assert (b.leader_id, b.leader_term, b.term) == ("kv-a", term, 0)  # a standby leads no term
        await a.stop()
        await poll(lambda: asyncio.sleep(0, b), lambda e: e.is_leader, "kv-b leads")
        assert b.term == await create_revision(etcd.endpoint, b.key) > term
        assert (a.term, a.leader_term) == (0, 0)
    finally:
        await a.stop()
        await b.stop()


async def test_a_leader_that_steps_down_wins_again_only_under_a_newer_term(candidates, poll, etcd):
    a = await candidates("kv-a")
    term = a.term
    lease = await key_lease(etcd.endpoint, a.key)
    a.step_down(term - 1, "a refusal of an older tenure's write")
    assert a.is_leader and a.term == term  # not this tenure's: nothing changes
    a.step_down(term, "a worker took a newer term")
    assert not a.is_leader and a.term == 0 and await a.confirm() == 0
    await poll(lambda: asyncio.sleep(0, a), lambda e: e.is_leader, "kv-a leads again")
    assert a.term > term and a.terms == 2
    assert not await lease_alive(etcd.endpoint, lease.lease_id)  # revoked: its old key went with it


async def test_a_leader_whose_key_went_behind_its_back_fails_to_confirm_and_steps_down(
    membership_config, etcd, poll
):
    held = HeldRounds()
    a = LeaderElection(membership_config, "kv_manager", "kv-a", sleep=held)
    try:
        await a.start()
        await a.wait_decided()
        term = a.term
        await revoke_key_lease(etcd.endpoint, a.key)
        assert a.is_leader  # its rounds are held: it still thinks it leads
        assert await a.confirm() == 0
        assert not a.is_leader and a.term == 0
        held.released.set()
        await poll(lambda: asyncio.sleep(0, a), lambda e: e.is_leader, "kv-a leads again")
        assert a.term > term
    finally:
        await a.stop()
