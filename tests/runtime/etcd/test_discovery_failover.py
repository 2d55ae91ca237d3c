"""ServiceLocator with several members, against a real etcd: a refresh after a member failed
picks another one (the failed one may stay listed until its lease expires), and a call that
meets an unavailable member is made on another, a bounded number of times."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest
from support.store_replicas import Prefer

from services.runtime.errors import Unavailable
from services.runtime.etcd import discovery
from services.runtime.etcd.discovery import MEMBER_TRIES, MemberUnavailable, ServiceLocator
from services.runtime.etcd.membership import MemberInfo, MemberRegistration


@contextlib.asynccontextmanager
async def _members(config, count: int):
    """``count`` schedulers registered at fake addresses (nothing is called at them)."""
    registrations = [
        MemberRegistration(
            config, MemberInfo("scheduler", f"s-{i}", f"127.0.0.1:{5001 + i}", "", "test", 0.0)
        )
        for i in range(count)
    ]
    for registration in registrations:
        await registration.start()
    try:
        yield [registration.member.address for registration in registrations]
    finally:
        for registration in registrations:
            await registration.stop()


@pytest.mark.integration
async def test_a_refresh_avoiding_the_member_in_use_picks_another_and_keeps_it(
    etcd, membership_config, monkeypatch
):
    async with _members(membership_config, 2) as (first, second):
        monkeypatch.setattr(discovery, "random", Prefer(first))
        locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)
        assert await locator.address() == first
        assert await locator.address(refresh=True, avoid=first) == second
        # Still listed, but no longer in use: a plain refresh keeps the member that answers.
        assert await locator.address(refresh=True) == second
        assert await locator.address() == second


@pytest.mark.integration
async def test_the_only_member_is_returned_even_when_avoided(etcd, membership_config):
    async with _members(membership_config, 1) as (only,):
        locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)
        assert await locator.address(refresh=True, avoid=only) == only


class _CountedLookups:
    """Stands in for ``list_members``: the real one, each call counted."""

    def __init__(self):
        self.calls = 0
        self.real = discovery.list_members

    async def __call__(self, config, service):
        self.calls += 1
        return await self.real(config, service)


@pytest.mark.integration
async def test_a_burst_of_refreshes_after_a_failure_shares_one_lookup(etcd, membership_config, monkeypatch):
    lookups = _CountedLookups()
    monkeypatch.setattr(discovery, "list_members", lookups)
    async with _members(membership_config, 2) as (first, second):
        monkeypatch.setattr(discovery, "random", Prefer(first))
        locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)
        assert await locator.address() == first
        picked = await asyncio.gather(*(locator.address(refresh=True, avoid=first) for _ in range(10)))
    assert picked == [second] * 10 and lookups.calls == 2


class _Gone:
    """An attempt that finds every member gone; the addresses it was made at."""

    def __init__(self):
        self.tried: list[str] = []

    async def __call__(self, address: str):
        self.tried.append(address)
        raise MemberUnavailable(f"{address} is gone")


@pytest.mark.integration
@pytest.mark.parametrize("members", [1, 2, 4])
async def test_a_call_tries_another_member_after_each_unavailable_one_a_bounded_number_of_times(
    etcd, membership_config, members
):
    async with _members(membership_config, members) as addresses:
        locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)
        gone = _Gone()
        with pytest.raises(MemberUnavailable):
            await locator.on_live_member(gone)
    tried = gone.tried
    # A lone member is tried twice (its failure may have been its connection's, or it may have
    # been replaced meanwhile); more, each after another.
    assert len(tried) == min(MEMBER_TRIES, max(2, members)) and set(tried) <= set(addresses)
    assert members == 1 or all(a != b for a, b in itertools.pairwise(tried))


@pytest.mark.integration
async def test_a_call_succeeds_on_the_member_after_an_unavailable_one(etcd, membership_config, monkeypatch):
    async with _members(membership_config, 2) as (dead, live):
        monkeypatch.setattr(discovery, "random", Prefer(dead))
        locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)

        async def answer(address: str) -> str:
            if address == dead:
                raise MemberUnavailable(f"{address} is gone")
            return address

        assert await locator.on_live_member(answer) == live
        assert await locator.address() == live  # later calls go straight to the live member


@pytest.mark.integration
async def test_other_failures_are_not_tried_elsewhere(etcd, membership_config):
    async with _members(membership_config, 2):
        locator = ServiceLocator("scheduler", etcd_endpoints=membership_config.etcd_endpoints)
        tried = []

        async def refused(address: str):
            tried.append(address)
            raise Unavailable("the member is draining")  # its own answer, not its absence

        with pytest.raises(Unavailable, match="draining"):
            await locator.on_live_member(refused)
    assert len(tried) == 1


async def test_a_fixed_address_is_tried_once():
    locator = ServiceLocator("scheduler", fixed="127.0.0.1:5001")
    gone = _Gone()
    with pytest.raises(MemberUnavailable):
        await locator.on_live_member(gone)
    assert gone.tried == ["127.0.0.1:5001"]
