"""The tenants file is read again when it changes, as the TLS certificates are: an edit of keys
and limits takes effect in a running gateway core without a restart. The core is a real one in
front of the scripted worker (conftest.py); the file is looked at on a fake clock, so nothing
sleeps: the test moves the clock past the check interval."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from support.polling import poll_until

from mesh_api.v1 import types_pb2
from services.gateway.auth import TENANTS_CHECK_INTERVAL_S, ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.runtime.errors import ResourceExhausted, Unauthenticated
from tests.gateway.in_memory_store import shared_renderer


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenants(keys: dict[str, str], **limits: dict) -> str:
    return json.dumps({"keys": keys, "tenants": limits})


async def generation(core: GatewayCore, tenant: str):
    """One of ``tenant``'s generations, admitted and in flight until closed."""
    held = core.generate(tenant, [1, 2, 3], None, types_pb2.SamplingParams(max_tokens=4))
    await anext(held)
    return held


async def test_an_edit_of_keys_and_limits_takes_effect_without_a_restart(
    scripted_gateway, tokenizer_bundle, tmp_path, caplog
):
    scripted_gateway.worker.script = scripted_gateway.core.encode(" one two three four")
    path = tmp_path / "tenants.json"
    one_at_a_time = {"max_concurrent_requests": 1, "max_waiting_requests": 0}
    path.write_text(tenants({"key-carol": "carol"}, carol=one_at_a_time))
    clock = FakeClock()
    core = GatewayCore(
        GatewayConfig(), ApiKeys.from_config("key-admin=admin", str(path), clock), renderer=shared_renderer()
    )
    core.attach(tokenizer_bundle, scripted_gateway.core.relay)

    assert core.tenant("Bearer key-carol") == "carol"
    with pytest.raises(Unauthenticated):
        core.tenant("Bearer key-dave")
    first = await generation(core, "carol")
    with pytest.raises(ResourceExhausted, match="max_concurrent_requests"):
        await generation(core, "carol")

    # carol's key rotated, dave added, carol may run two at once.
    path.write_text(
        tenants({"key-carol-2": "carol", "key-dave": "dave"}, carol={"max_concurrent_requests": 2})
    )
    assert core.tenant("Bearer key-carol") == "carol"  # not looked at again within the interval
    clock.now += TENANTS_CHECK_INTERVAL_S
    assert core.tenant("Bearer key-dave") == "dave"
    assert core.tenant("Bearer key-carol-2") == "carol"
    assert core.tenant("Bearer key-admin") == "admin"  # --api-keys' keys stay
    with pytest.raises(Unauthenticated):
        core.tenant("Bearer key-carol")
    second = await generation(core, "carol")  # the new limit, with the first still in flight
    assert core.quota.in_flight("carol") == 2

    # A file that does not parse (half written, a typo) leaves what is in force, logged once.
    path.write_text('{"keys": {"key-eve": ')
    with caplog.at_level(logging.WARNING, logger="loramesh.reload"):
        for _ in range(2):
            clock.now += TENANTS_CHECK_INTERVAL_S
            assert core.tenant("Bearer key-dave") == "dave"
    assert len([r for r in caplog.records if "the tenants file changed" in r.message]) == 1
    for held in (first, second):
        await held.aclose()
    assert core.quota.in_flight("carol") == 0


async def test_a_raised_limit_admits_the_generations_waiting_for_a_slot(
    scripted_gateway, tokenizer_bundle, tmp_path
):
    scripted_gateway.worker.script = scripted_gateway.core.encode(" one two three four")
    path = tmp_path / "tenants.json"
    path.write_text(tenants({"key-carol": "carol"}, carol={"max_concurrent_requests": 1}))
    keys = ApiKeys.from_config("", str(path), FakeClock())
    core = GatewayCore(GatewayConfig(), keys, renderer=shared_renderer())
    core.attach(tokenizer_bundle, scripted_gateway.core.relay)
    first = await generation(core, "carol")
    waiting = asyncio.create_task(generation(core, "carol"))

    async def waiters() -> int:
        return core.quota.waiting("carol")

    await poll_until(waiters, lambda n: n == 1, "carol's second generation waits for a slot")
    path.write_text(tenants({"key-carol": "carol"}, carol={"max_concurrent_requests": 2}))
    assert keys.reload()  # the check a request makes, run now
    second = await waiting
    assert (core.quota.in_flight("carol"), core.quota.waiting("carol")) == (2, 0)
    for held in (first, second):
        await held.aclose()
