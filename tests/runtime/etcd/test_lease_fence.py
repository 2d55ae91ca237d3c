"""The lease fence on an injected clock: up 2/3 of the TTL after the last answered keepalive was
sent, at once when etcd says the lease is gone, down again with the next answered keepalive; and
a registration cut off from a real etcd (a partition, tests/support/tcp_link.py) raises it."""

from __future__ import annotations

import pytest
from support.polling import poll_until
from support.tcp_link import TcpLink

from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.lease_fence import FENCE_FRACTION, LeaseFence
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_fence_goes_up_two_thirds_of_the_ttl_after_the_last_answered_keepalive_was_sent():
    clock = Clock()
    fence = LeaseFence(15, clock)
    assert "not registered in etcd" in fence.problem()
    fence.renewed(sent_at=clock.now, ttl_s=15)
    assert fence.fence_after_s == 15 * FENCE_FRACTION == 10
    clock.now += 9.99
    fence.failed("etcd at 10.0.0.1:2379: timed out")
    assert fence.problem() == ""  # a failed keepalive alone fences no one
    clock.now += 0.01
    problem = fence.problem()
    assert "lost etcd" in problem and "10.0 s" in problem and "timed out" in problem
    fence.renewed(sent_at=clock.now - 1, ttl_s=15)  # a keepalive sent a second ago was answered
    assert fence.problem() == ""


def test_the_fence_goes_up_at_once_when_etcd_says_the_lease_is_gone():
    clock = Clock()
    fence = LeaseFence(15, clock)
    fence.renewed(sent_at=clock.now, ttl_s=15)
    fence.lost("lease 7f not found in etcd")
    assert "lost its etcd lease (lease 7f not found in etcd)" in fence.problem()
    fence.renewed(sent_at=clock.now, ttl_s=15)  # registered again under a new lease
    assert fence.problem() == ""


def test_the_granted_ttl_sets_the_fence():
    fence = LeaseFence(15, Clock())
    fence.renewed(sent_at=0.0, ttl_s=30)  # etcd may grant more than asked, never less
    assert fence.fence_after_s == 20


@pytest.mark.integration
async def test_a_registration_cut_off_from_etcd_is_fenced_and_told_and_unfenced_once_back(etcd: EtcdServer):
    clock = Clock()
    told: list[str] = []

    async def on_fence(problem: str) -> None:
        told.append(problem)

    link = await TcpLink(etcd.endpoint).start()
    config = MembershipConfig(etcd_endpoints=link.address, ttl_s=2, load_interval_s=0.5)
    registration = MemberRegistration(
        config, MemberInfo.create("gpu_worker", "127.0.0.1:1"), clock=clock, on_fence=on_fence
    )
    try:
        await registration.start()
        assert registration.fence.problem() == ""
        link.cut()

        async def registered() -> bool:
            return registration.registered

        await poll_until(registered, lambda yes: not yes, "a keepalive through the cut link failed")
        assert registration.fence.problem() == ""  # not yet: a keepalive failed, the lease lives on
        clock.now += registration.fence.fence_after_s + 0.1
        assert "lost etcd" in registration.fence.problem()

        async def told_so_far() -> list[str]:
            return told

        await poll_until(told_so_far, lambda t: len(t) == 1, "the registration told the fence went up")
        assert "lost etcd" in told[0] and "etcd at" in told[0]
        link.heal()
        await poll_until(told_so_far, lambda t: len(t) == 2, "the registration told the fence went down")
        assert told[1] == "" and registration.registrations == 2 and registration.fence.problem() == ""
    finally:
        await registration.stop()
        await link.close()
