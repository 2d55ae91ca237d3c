"""ServiceLocator against a real etcd: a burst of first lookups shares one etcd query, and a
failed lookup is retried by the next call."""

from __future__ import annotations

import asyncio

import pytest
from support.store_replicas import Prefer

from services.runtime.errors import Unavailable
from services.runtime.etcd import discovery
from services.runtime.etcd.discovery import ServiceLocator, first_answer
from services.runtime.etcd.membership import MemberInfo, MemberRegistration


async def test_a_burst_of_first_lookups_queries_etcd_once(etcd, membership_config, monkeypatch):
    queries = []
    real = discovery.list_members

    async def counted(config, service):
        queries.append(service)
        return await real(config, service)

    monkeypatch.setattr(discovery, "list_members", counted)
    locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)
    with pytest.raises(Unavailable, match="no scheduler is registered"):
        await asyncio.gather(*(locator.address() for _ in range(3)))
    assert len(queries) == 1
    registration = MemberRegistration(
        membership_config, MemberInfo("scheduler", "s-1", "127.0.0.1:5001", "", "test", 0.0)
    )
    await registration.start()
    try:
        addresses = await asyncio.gather(*(locator.address() for _ in range(20)))
    finally:
        await registration.stop()
    assert addresses == ["127.0.0.1:5001"] * 20 and len(queries) == 2  # the failure was not cached


async def test_a_read_that_misses_its_timeout_is_tried_again_a_bounded_number_of_times(monkeypatch):
    outcomes = [Unavailable("etcd unreachable (timed out)")] * (discovery.LOOKUP_ATTEMPTS - 1)

    async def flaky(config, service):
        if outcomes:
            raise outcomes.pop()
        return [MemberInfo("scheduler", "s-1", "127.0.0.1:5001", "", "test", 0.0)]

    monkeypatch.setattr(discovery, "list_members", flaky)
    locator = ServiceLocator("scheduler", etcd_endpoints="127.0.0.1:1")
    assert await locator.address() == "127.0.0.1:5001"
    outcomes.extend([Unavailable("etcd unreachable (timed out)")] * discovery.LOOKUP_ATTEMPTS)
    with pytest.raises(Unavailable, match="timed out"):
        await locator.address(refresh=True)


async def test_a_member_that_does_not_answer_is_left_for_another_which_gets_the_whole_deadline(monkeypatch):
    async def two(config, service):
        return [MemberInfo("adapter_store", f"s-{i}", f"127.0.0.1:500{i}", "", "test", 0.0) for i in (1, 2)]

    monkeypatch.setattr(discovery, "list_members", two)
    monkeypatch.setattr(discovery, "random", Prefer("127.0.0.1:5001"))
    tries = []

    async def attempt(address: str, within_s: float | None) -> str:
        tries.append((address, within_s))
        answer = asyncio.Event().wait() if address == "127.0.0.1:5001" else asyncio.sleep(0, "answered")
        return await first_answer(answer, within_s, address)

    locator = ServiceLocator("adapter_store", etcd_endpoints="127.0.0.1:1")
    assert await locator.on_answering_member(attempt, 0.05) == "answered"
    assert tries == [("127.0.0.1:5001", 0.05), ("127.0.0.1:5002", None)]
    assert await locator.address() == "127.0.0.1:5002"  # kept for the next call
