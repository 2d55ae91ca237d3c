"""The tenants' limits held across gateways sharing a real etcd: two gateways' quotas, each with
its slots and its count of the live gateways, as two gateway processes hold them."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.gateway.shared_quota import SharedQuota
from services.gateway.tenant_quota import Admission, QuotaConfig, TenantLimits, TenantQuota
from services.runtime.errors import ResourceExhausted, Unavailable
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.runtime.rpc.server import start_service
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def gateway(config: MembershipConfig, name: str, limits: TenantLimits, clock=None):
    """One gateway's quota on ``config``'s etcd, registered as a live gateway."""
    shared = SharedQuota(config, name, retry_s=0.05)
    await shared.start()
    quota = TenantQuota(QuotaConfig({"alice": limits}), clock=clock or FakeClock(), shared=shared)
    member = MemberRegistration(
        config, MemberInfo.create("gateway", f"127.0.0.1:{len(name)}", instance_id=name)
    )
    await member.start()
    try:
        yield quota
    finally:
        await member.stop()
        await shared.close()


async def refused(quota: TenantQuota) -> str:
    with pytest.raises(ResourceExhausted) as error:
        await quota.acquire("alice", 10)
    assert "\n" not in str(error.value)
    return str(error.value)


async def admitted(quota: TenantQuota) -> Admission | None:
    """An admission, or None while the limit is held elsewhere."""
    try:
        return await quota.acquire("alice", 10)
    except ResourceExhausted:
        return None


async def test_a_tenant_limited_to_n_has_at_most_n_in_flight_across_two_gateways(membership_config):
    limits = TenantLimits(max_concurrent_requests=3, max_waiting_requests=0)
    async with (
        gateway(membership_config, "gw-a", limits) as a,
        gateway(membership_config, "gw-b", limits) as b,
    ):
        held = [await a.acquire("alice", 10), await b.acquire("alice", 10), await a.acquire("alice", 10)]
        assert "limit of 3 requests in flight across the gateways" in await refused(a)
        await refused(b)
        assert (await b.acquire("bob", 10)) is not None  # bob has no limits: no slot, no etcd call
        held.pop(0).settle(10)  # a's: free in etcd for either gateway
        held.append(await poll_until(lambda: admitted(b), bool, "b takes the slot a freed"))
        await refused(a)
        assert (a.in_flight("alice"), b.in_flight("alice")) == (1, 2)
        for admission in held:
            admission.settle(10)


async def test_when_a_gateway_leaves_the_other_gets_all_n_and_its_waiters_get_the_freed_slots(
    membership_config,
):
    limits = TenantLimits(max_concurrent_requests=2, max_waiting_requests=1)
    async with gateway(membership_config, "gw-b", limits) as b:
        async with gateway(membership_config, "gw-a", limits) as a:
            mine = [await a.acquire("alice", 10), await a.acquire("alice", 10)]
            waiter = asyncio.create_task(b.acquire("alice", 10))  # b's room: it waits for a's slots
            await poll_until(lambda: asyncio.sleep(0, b.waiting("alice")), lambda n: n == 1, "b's waiter")
            assert "1 waiting" in await refused(b)
            mine[0].settle(10)
            (await waiter).settle(10)  # found the slot a freed by trying again
            # a goes with a generation in flight: its lease is revoked, its slot free
        first = await poll_until(lambda: admitted(b), bool, "b takes the slot a held")
        second = await b.acquire("alice", 10)
        assert b.in_flight("alice") == 2
        third = asyncio.create_task(b.acquire("alice", 10))
        await poll_until(lambda: asyncio.sleep(0, b.waiting("alice")), lambda n: n == 1, "b's third waits")
        first.settle(10)  # handed to b's own waiter, no etcd call
        (await third).settle(10)
        second.settle(10)


async def test_tokens_per_minute_are_shared_by_the_live_gateways(membership_config):
    clock = FakeClock()
    limits = TenantLimits(tokens_per_minute=600)  # 10 per second; 600 in the whole bucket
    async with gateway(membership_config, "gw-a", limits, clock) as a:
        async with gateway(membership_config, "gw-b", limits):
            await poll_until(lambda: asyncio.sleep(0, a.shared.gateways), lambda n: n == 2, "two gateways")
            assert a.tokens_left("alice") == pytest.approx(300)  # its share: half the bucket
            (await a.acquire("alice", 100)).settle(100)
            with pytest.raises(ResourceExhausted, match="600 tokens per minute") as error:
                await a.acquire("alice", 201)
            assert error.value.retry_after_s == pytest.approx(0.2)  # 1 token at half the rate: 5 per second
            (await a.acquire("alice", 200)).settle(200)
        await poll_until(lambda: asyncio.sleep(0, a.shared.gateways), lambda n: n == 1, "b gone")
        assert a.tokens_left("alice") == pytest.approx(0)  # b's tokens do not come to a at once
        clock.now += 30
        assert a.tokens_left("alice") == pytest.approx(300)  # the whole rate: 10 per second


async def test_a_gateway_cut_off_from_etcd_refuses_limited_tenants_and_their_waiters_in_one_line(
    membership_config, etcd
):
    limits = TenantLimits(max_concurrent_requests=1, max_waiting_requests=1)
    async with gateway(membership_config, "gw-a", limits) as a:
        held = await a.acquire("alice", 10)
        waiter = asyncio.create_task(a.acquire("alice", 10))
        await poll_until(lambda: asyncio.sleep(0, a.waiting("alice")), lambda n: n == 1, "a waiter")
        etcd.stop()
        for refusal in [waiter, a.acquire("alice", 10)]:
            with pytest.raises(Unavailable) as error:
                await refusal
            message = str(error.value)
            assert message.startswith(
                "tenant 'alice' has a max_concurrent_requests limit shared by the gateways through etcd, "
                "which this gateway cannot reach (cannot "
            )
            assert f"etcd at {etcd.endpoint} unreachable" in message
            assert "\n" not in message
        (await a.acquire("bob", 10)).settle(10)  # no limit: nothing to share
        held.settle(10)  # its slot's lease frees it


async def test_two_gateway_services_on_one_etcd_share_the_limit(tmp_path, etcd):
    tenants = tmp_path / "tenants.json"
    limits = {"max_concurrent_requests": 1, "max_waiting_requests": 0}
    tenants.write_text(json.dumps({"keys": {"key-alice": "alice"}, "tenants": {"alice": limits}}))
    config = GatewayConfig(etcd_endpoints=etcd.endpoint, api_keys_file=str(tenants), grace_s=1)
    first = await start_service(GatewayService(config), config)
    second = await start_service(GatewayService(config), config)
    a, b = first.service.core.quota, second.service.core.quota
    try:
        await poll_until(
            lambda: asyncio.sleep(0, (a.shared.gateways, b.shared.gateways)),
            lambda n: n == (2, 2),
            "both count 2",
        )
        held = await a.acquire("alice", 10)
        assert "limit of 1 requests in flight across the gateways" in await refused(b)
        held.settle(10)
        await first.shutdown()  # its slots' lease revoked, its membership gone
        (await poll_until(lambda: admitted(b), bool, "b alone takes the slot")).settle(10)
        await poll_until(lambda: asyncio.sleep(0, b.shared.gateways), lambda n: n == 1, "one gateway")
    finally:
        await first.shutdown()
        await second.shutdown()
