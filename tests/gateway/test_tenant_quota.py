"""The tenants' limits on their own (a fake clock, no sleeping) and the tenants file that sets them."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace

import pytest

from loramesh_cli.mesh_commands import _gateway_keys_copy
from services.gateway.auth import ApiKeys, TenantsFile, hashed_keys
from services.gateway.tenant_quota import QuotaConfig, TenantLimits, TenantQuota
from services.runtime.errors import InvalidArgument, ResourceExhausted


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quota(clock: FakeClock, window_s: float = 60.0, **limits) -> TenantQuota:
    return TenantQuota(QuotaConfig({"alice": TenantLimits(**limits)}, window_s), clock=clock)


def test_concurrency_is_counted_per_tenant_and_freed_when_settled():
    q = quota(FakeClock(), max_concurrent_requests=2)
    first, second = q.admit("alice", 10), q.admit("alice", 10)
    with pytest.raises(ResourceExhausted, match="2 requests in flight") as refused:
        q.admit("alice", 10)
    assert refused.value.retry_after_s == 1.0
    q.admit("bob", 10)  # bob has no limits: never counted against alice
    first.settle(5)
    first.settle(5)  # twice is once
    assert q.in_flight("alice") == 1
    q.admit("alice", 10)
    second.settle(0)


def test_tokens_per_minute_refill_in_the_window_and_the_hint_is_exact():
    clock = FakeClock()
    q = quota(clock, tokens_per_minute=600)  # 10 tokens per second, 600 in the bucket
    q.admit("alice", 500).settle(500)
    with pytest.raises(ResourceExhausted, match="600 tokens per minute") as refused:
        q.admit("alice", 200)
    assert refused.value.retry_after_s == pytest.approx(10.0)  # 100 missing, 10 per second
    clock.now += 9.999
    with pytest.raises(ResourceExhausted):
        q.admit("alice", 200)
    clock.now += refused.value.retry_after_s - 9.999
    q.admit("alice", 200)


def test_requests_refused_together_are_told_to_come_back_one_by_one_each_to_its_charge():
    clock = FakeClock()
    q = quota(clock, tokens_per_minute=600)  # 10 tokens per second
    q.admit("alice", 600).settle(600)  # the bucket is empty
    hints = []
    for _ in range(3):  # three clients refused at once, 20 tokens each
        with pytest.raises(ResourceExhausted) as refused:
            q.admit("alice", 20)
        hints.append(refused.value.retry_after_s)
    assert hints == pytest.approx([2.0, 4.0, 6.0])  # not all 2.0: only one would fit then
    start = clock.now
    for hint in hints:  # each comes back on its hint and fits
        clock.now = start + hint
        q.admit("alice", 20).settle(20)
    clock.now += 100.0  # the queue has long drained: a refusal's hint is the bucket's alone
    q.admit("alice", 600).settle(600)
    with pytest.raises(ResourceExhausted) as refused:
        q.admit("alice", 20)
    assert refused.value.retry_after_s == pytest.approx(2.0)


def test_a_generation_is_charged_its_largest_cost_then_refunded_to_what_it_used():
    clock = FakeClock()
    q = quota(clock, tokens_per_minute=100)
    admitted = q.admit("alice", 80)  # prompt + max_tokens
    assert q.tokens_left("alice") == pytest.approx(20)
    admitted.settle(30)  # prompt + what it generated
    assert q.tokens_left("alice") == pytest.approx(70)
    q.admit("alice", 50).settle(0)  # failed before its first delta: free
    assert q.tokens_left("alice") == pytest.approx(70)


def test_a_request_larger_than_the_bucket_waits_for_a_full_bucket_and_leaves_it_in_debt():
    clock = FakeClock()
    q = quota(clock, window_s=6.0, tokens_per_minute=600)  # the window holds 60 tokens
    q.admit("alice", 10).settle(10)
    with pytest.raises(ResourceExhausted) as refused:
        q.admit("alice", 200)
    assert refused.value.retry_after_s == pytest.approx(1.0)  # until the bucket is full again
    clock.now += 1.0
    q.admit("alice", 200).settle(200)
    assert q.tokens_left("alice") == pytest.approx(-140)
    with pytest.raises(ResourceExhausted) as refused:
        q.admit("alice", 1)
    assert refused.value.retry_after_s == pytest.approx(14.1)


async def _waiter(q: TenantQuota, order: list[str], name: str):
    """A generation that waits for alice's slot, noting when it got it."""
    admission = await q.acquire("alice", 10)
    order.append(name)
    return admission


async def _settled_loop() -> None:
    """Let every task that can run, run (the waiters' wake-ups)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_past_the_limit_generations_wait_in_turn_and_a_full_room_is_refused():
    q = quota(FakeClock(), max_concurrent_requests=2, max_waiting_requests=2)
    running = [await q.acquire("alice", 10), await q.acquire("alice", 10)]
    order: list[str] = []
    third = asyncio.create_task(_waiter(q, order, "third"))
    await _settled_loop()
    fourth = asyncio.create_task(_waiter(q, order, "fourth"))
    await _settled_loop()
    assert q.waiting("alice") == 2 and order == []
    with pytest.raises(ResourceExhausted, match="max_waiting_requests 2") as refused:
        await q.acquire("alice", 10)  # the room is full
    assert refused.value.retry_after_s == 1.0
    with pytest.raises(ResourceExhausted):
        q.admit("alice", 10)  # no newcomer goes ahead of a waiter
    running[0].settle(10)
    await _settled_loop()
    assert order == ["third"] and q.in_flight("alice") == 2  # the slot was handed over, not freed
    # A slot freed while someone waits is not up for grabs, even for a caller that asks first.
    running[1].settle(10)
    with pytest.raises(ResourceExhausted):
        q.admit("alice", 10)
    await _settled_loop()
    assert order == ["third", "fourth"]
    (await third).settle(10), (await fourth).settle(10)
    assert q.in_flight("alice") == 0 and q.waiting("alice") == 0


async def test_a_waiter_that_goes_leaves_its_place_and_a_slot_handed_to_it_passes_on():
    q = quota(FakeClock(), max_concurrent_requests=1)  # a room as large as the limit: 1
    holder = await q.acquire("alice", 10)
    order: list[str] = []
    gone = asyncio.create_task(_waiter(q, order, "gone"))
    await _settled_loop()
    gone.cancel()  # its client disconnected while it waited
    await _settled_loop()
    assert q.waiting("alice") == 0
    next_one = asyncio.create_task(_waiter(q, order, "next"))
    await _settled_loop()
    late = asyncio.create_task(_waiter(q, order, "late"))  # refused: the room holds one
    await _settled_loop()
    assert late.done() and isinstance(late.exception(), ResourceExhausted)
    holder.settle(10)
    next_one.cancel()  # cancelled in the same turn as its slot was handed to it
    await _settled_loop()
    assert next_one.cancelled() and order == []
    assert q.in_flight("alice") == 0  # the slot it was handed is free again
    (await q.acquire("alice", 10)).settle(10)


async def test_no_waiting_room_refuses_at_once_and_a_token_refusal_frees_the_slot_it_waited_for():
    q = quota(FakeClock(), max_concurrent_requests=1, max_waiting_requests=0)
    held = await q.acquire("alice", 10)
    with pytest.raises(ResourceExhausted, match="max_concurrent_requests"):
        await q.acquire("alice", 10)
    held.settle(10)
    q = quota(FakeClock(), max_concurrent_requests=1, tokens_per_minute=60)  # a bucket of 60
    held = await q.acquire("alice", 50)
    waiter = asyncio.create_task(q.acquire("alice", 40))
    await _settled_loop()
    assert q.waiting("alice") == 1
    held.settle(50)  # the slot goes to the waiter, whose 40 tokens the bucket's 10 do not hold
    await _settled_loop()
    assert isinstance(waiter.exception(), ResourceExhausted)
    assert q.in_flight("alice") == 0 and q.waiting("alice") == 0


def test_the_waiting_room_defaults_to_the_concurrency_limit_and_round_trips():
    assert TenantLimits(max_concurrent_requests=3).waiting_room == 3
    assert TenantLimits(max_concurrent_requests=3, max_waiting_requests=0).waiting_room == 0
    assert TenantLimits(tokens_per_minute=5).waiting_room == 0
    config = QuotaConfig({"alice": TenantLimits(2, 0, 7), "bob": TenantLimits(1)})
    assert config.to_json()["tenants"] == {
        "alice": {"max_concurrent_requests": 2, "max_waiting_requests": 7},
        "bob": {"max_concurrent_requests": 1},
    }
    assert QuotaConfig.parse(config.to_json()["tenants"]) == config


def test_unlimited_by_default_and_the_star_entry_covers_every_other_tenant():
    assert TenantQuota().config.for_tenant("anyone") == TenantLimits()
    config = QuotaConfig({"*": TenantLimits(max_concurrent_requests=1), "vip": TenantLimits()})
    assert config.for_tenant("carol").max_concurrent_requests == 1
    q = TenantQuota(config)
    q.admit("carol", 1)
    with pytest.raises(ResourceExhausted):
        q.admit("carol", 1)
    q.admit("dave", 1)  # each tenant its own count
    q.admit("vip", 1), q.admit("vip", 1)


def test_the_tenants_file_sets_keys_limits_and_window(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(
        json.dumps(
            {
                "keys": {"key-alice": "alice", "key-bob": "bob"},
                "tenants": {"alice": {"max_concurrent_requests": 4, "tokens_per_minute": 1000}},
                "quota_window_s": 10,
            }
        )
    )
    keys = ApiKeys.from_config("key-carol=carol", str(path))
    assert keys.tenant_for("Bearer key-alice") == "alice" and keys.tenant_for("Bearer key-carol") == "carol"
    assert keys.quotas.for_tenant("alice") == TenantLimits(4, 1000)
    assert keys.quotas.window_s == 10 and keys.quotas.for_tenant("bob") == TenantLimits()
    assert ApiKeys.read_file(str(path)) == {"key-alice": "alice", "key-bob": "bob"}
    # What `loramesh up` writes for the gateways: the same limits, the keys hashed.
    written = TenantsFile(hashed_keys(ApiKeys.read_file(str(path))), keys.quotas).to_json()
    again = TenantsFile.parse(json.loads(json.dumps(written)))
    assert again.quotas == keys.quotas and "key-alice" not in json.dumps(written)
    # The plain form is still the plain form.
    assert TenantsFile.parse({"k": "alice"}).to_json() == {"k": "alice"}


@pytest.mark.parametrize(
    "content, named",
    [
        ({"keys": {"k": "a"}, "tenant": {}}, "unknown fields ['tenant']"),
        (
            {"keys": {"k": "a"}, "tenants": {"a": {"tokens_per_second": 1}}},
            "unknown fields ['tokens_per_second']",
        ),
        ({"keys": {"k": "a"}, "tenants": {"a": {"max_concurrent_requests": -1}}}, "max_concurrent_requests"),
        ({"keys": {"k": "a"}, "tenants": {"a": {"tokens_per_minute": 1.5}}}, "tokens_per_minute"),
        ({"keys": {"k": "a"}, "tenants": {"a": 5}}, "tenants['a'] must be an object"),
        ({"keys": {"k": "a"}, "quota_window_s": 0}, "quota_window_s"),
        ({"keys": {"k": 1}}, "api key (or its hash) -> tenant"),
    ],
)
def test_a_malformed_tenants_file_is_refused_naming_the_field(content, named):
    with pytest.raises(InvalidArgument) as refused:
        TenantsFile.parse(content)
    assert named in refused.value.message


def test_loramesh_up_hands_the_tenants_limits_to_its_gateways_with_the_keys_hashed(tmp_path):
    given = tmp_path / "tenants.json"
    given.write_text(
        json.dumps({"keys": {"key-alice": "alice"}, "tenants": {"*": {"tokens_per_minute": 900}}})
    )
    written = _gateway_keys_copy(Namespace(api_keys_file=str(given)), tmp_path, "admin-key").path
    assert "key-alice" not in written.read_text() and "admin-key" not in written.read_text()
    keys = ApiKeys.from_config("", str(written))
    assert keys.tenant_for("Bearer key-alice") == "alice" and keys.tenant_for("Bearer admin-key") == "admin"
    assert (
        keys.quotas.for_tenant("alice")
        == keys.quotas.for_tenant("admin")
        == TenantLimits(tokens_per_minute=900)
    )
    given.write_text(json.dumps({"key-alice": "alice"}))  # the plain form stays plain
    plain = json.loads(
        _gateway_keys_copy(Namespace(api_keys_file=str(given)), tmp_path, "admin-key").path.read_text()
    )
    assert sorted(plain.values()) == ["admin", "alice"]
