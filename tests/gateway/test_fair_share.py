"""The render processes are lent to tenants in turn: a tenant holding all but one cannot take the
last, a newcomer gets a free one at once, freed ones go round the waiting tenants, and a waiter
that gives up leaves nothing lent to nobody."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.gateway.fair_share import FairShare


async def settled() -> None:
    """Lets every task that can run, run."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_tenant_holds_all_but_one_and_a_newcomer_gets_the_last_at_once():
    share = FairShare(["p1", "p2", "p3"], per_tenant=2)
    held = [await share.acquire("bob"), await share.acquire("bob")]
    bob_third = asyncio.create_task(share.acquire("bob"))
    await settled()
    assert not bob_third.done()
    assert await share.acquire("alice") not in held  # the last one, at once
    share.release("bob", held[0])
    assert await bob_third == held[0]


async def test_freed_ones_go_round_the_waiting_tenants_first_come_first_served_within_each():
    share = FairShare(["p"], per_tenant=1)
    first = await share.acquire("bob")
    order = []

    async def wait(tenant: str, n: int):
        item = await share.acquire(tenant)
        order.append(f"{tenant}{n}")
        share.release(tenant, item)

    waiters = [asyncio.create_task(wait("bob", 1)), asyncio.create_task(wait("bob", 2))]
    await settled()
    waiters += [asyncio.create_task(wait("alice", 1)), asyncio.create_task(wait("carol", 1))]
    await settled()
    share.release("bob", first)
    await asyncio.gather(*waiters)
    assert order == ["bob1", "alice1", "carol1", "bob2"]


async def test_a_waiter_that_gives_up_leaves_nothing_lent():
    share = FairShare(["p"], per_tenant=1)
    first, gave_up = await bob_holds_alice_waits(share)
    gave_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gave_up
    share.release("bob", first)
    assert await share.acquire("carol") == "p"


async def bob_holds_alice_waits(share: FairShare) -> tuple[str, asyncio.Task]:
    """bob holds the one item; alice's wait for it, under way."""
    held = await share.acquire("bob")
    waiter = asyncio.create_task(share.acquire("alice"))
    await settled()
    return held, waiter


async def test_a_waiter_cancelled_as_its_item_arrives_gives_it_back():
    share = FairShare(["p"], per_tenant=1)
    first, waiter = await bob_holds_alice_waits(share)
    share.release("bob", first)  # handed over to alice's waiter, not yet resumed
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await settled()
    assert await share.acquire("carol") == "p"


async def test_an_item_given_back_from_another_thread_reaches_the_waiter_on_its_loop():
    share = FairShare(["p"], per_tenant=1)
    first, waiter = await bob_holds_alice_waits(share)
    thread = threading.Thread(target=share.release, args=("bob", first))
    thread.start()
    assert await waiter == "p"
    thread.join()
