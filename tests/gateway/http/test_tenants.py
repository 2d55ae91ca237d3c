"""Tenants cannot see each other's private adapters, and their limits hold, over HTTP and gRPC
alike: the scripted gateway core (conftest.py) behind its OpenAI app and a gRPC server with the
services' interceptor; the quota's clock is fake, so nothing sleeps. The official ``openai``
client and the SDK see the refusals and retry after them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import httpx2
import openai
import openai._base_client as openai_base_client
import pytest
from grpc import aio

from loramesh import AsyncClient, Client, NotFound, ResourceExhausted
from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2
from services.gateway.http.app import build_app
from services.gateway.servicer import GatewayServicer
from services.gateway.tenant_quota import QuotaConfig, TenantLimits, TenantQuota
from services.runtime.rpc.interceptors import ServiceInterceptor

ALICE = (("authorization", "Bearer key-alice"),)
BOB_HTTP = {"authorization": "Bearer key-bob"}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limit_alice(gateway, **limits) -> FakeClock:
    """Give alice ``limits``, on a fake clock."""
    clock = FakeClock()
    gateway.core.quota = TenantQuota(QuotaConfig({"alice": TenantLimits(**limits)}), clock=clock)
    gateway.worker.script = gateway.core.encode(" one two three four five six seven eight nine ten")
    return clock


def completion(gateway, **fields) -> dict:
    return {"model": gateway.core.base_model, "prompt": [1, 2, 3, 4], "max_tokens": 8, **fields}


async def hold_a_generation(gateway):
    """One of alice's generations, admitted and in flight until closed."""
    held = gateway.core.generate("alice", [1, 2, 3], None, types_pb2.SamplingParams(max_tokens=4))
    await anext(held)
    return held


@pytest.fixture
async def grpc_address(scripted_gateway) -> AsyncIterator[str]:
    """``loramesh.v1.Gateway`` over the scripted gateway's core."""
    server = aio.server(interceptors=[ServiceInterceptor()])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(scripted_gateway.parts), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)


async def refusal(call, *args) -> aio.AioRpcError:
    """What ``call(*args)`` (a unary or server-streaming RPC) failed with."""
    with pytest.raises(aio.AioRpcError) as raised:
        reply = call(*args)
        if hasattr(reply, "__aiter__"):
            async for _ in reply:
                pass
        else:
            await reply
    return raised.value


# -- private adapters ---------------------------------------------------------------------------


async def test_another_tenants_private_adapter_answers_over_http_as_a_missing_one(scripted_gateway):
    http = scripted_gateway.http

    async def both(method: str, path: str, body_of):
        """Bob's private ``secret`` and the missing ``ghost``: the same answer but for the name."""
        private, missing = [
            await http.request(method, path.format(model=model), json=body_of(model))
            for model in ("bob/secret", "bob/ghost")
        ]
        assert private.status_code == missing.status_code == 404, (path, private.text)
        assert private.text.replace("secret", "ghost") == missing.text, path
        return private, missing

    chat = lambda model: {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    private, _ = await both("POST", "/v1/chat/completions", chat)
    assert private.json()["error"]["message"] == (
        "the model 'bob/secret' does not exist or you do not have access to it"
    )
    await both("POST", "/v1/completions", lambda model: {"model": model, "prompt": "Hi"})
    await both("GET", "/v1/models/{model}", lambda model: None)
    await both("POST", "/tokenize", lambda model: {"model": model, "prompt": "Hi"})
    await both(
        "POST", "/generate", lambda model: {"inputs": "Hi", "parameters": {"adapter_id": model}}
    )  # LoRAX
    listed = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
    assert "bob/shared" in listed and not any("secret" in m for m in listed)
    assert scripted_gateway.worker.requests == []


async def test_another_tenants_private_adapter_answers_over_grpc_as_a_missing_one(grpc_address, tmp_path):
    async with aio.insecure_channel(grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for call in (
            lambda adapter: stub.GetAdapter(
                gateway_pb2.GatewayAdapterRequest(adapter=adapter), metadata=ALICE
            ),
            lambda adapter: stub.Generate(
                gateway_pb2.GenerateTextRequest(prompt="Hi", adapter=adapter), metadata=ALICE
            ),
            lambda adapter: stub.Chat(
                gateway_pb2.ChatRequest(
                    messages=[gateway_pb2.ChatMessage(role="user", content="Hi")], adapter=adapter
                ),
                metadata=ALICE,
            ),
        ):
            private = await refusal(call, "bob/secret")
            missing = await refusal(call, "bob/ghost")
            assert private.code() == missing.code() == grpc.StatusCode.NOT_FOUND
            assert private.details() == "adapter 'secret' of owner 'bob' not found"
            assert missing.details() == "adapter 'ghost' of owner 'bob' not found"  # the store's words
        # Changing another tenant's adapter is refused alike, whether it exists or not.
        for change in (
            lambda adapter: stub.DeleteAdapter(
                gateway_pb2.GatewayAdapterRequest(adapter=adapter), metadata=ALICE
            ),
            lambda adapter: stub.SetAdapterPinned(
                gateway_pb2.GatewayPinRequest(adapter=adapter), metadata=ALICE
            ),
        ):
            private = await refusal(change, "bob/secret")
            missing = await refusal(change, "bob/ghost")
            assert private.code() == missing.code() == grpc.StatusCode.PERMISSION_DENIED
            assert private.details().replace("secret", "ghost") == missing.details()
        models = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=ALICE)
        assert "bob/shared" in {m.id for m in models.models}
        assert not any("secret" in m.id for m in models.models)
    async with AsyncClient(grpc_address, "key-alice", retries=0, mesh_file=tmp_path / "none.json") as sdk:
        with pytest.raises(NotFound, match="adapter 'secret' of owner 'bob' not found"):
            await sdk.adapters.get("bob/secret")


# -- limits over HTTP ---------------------------------------------------------------------------


async def test_over_the_concurrency_limit_http_answers_429_with_retry_after(scripted_gateway):
    limit_alice(scripted_gateway, max_concurrent_requests=1, max_waiting_requests=0)
    http = scripted_gateway.http
    held = await hold_a_generation(scripted_gateway)
    refused = await http.post("/v1/completions", json=completion(scripted_gateway))
    assert refused.status_code == 429, refused.text
    assert (refused.headers["retry-after"], refused.headers["retry-after-ms"]) == ("1", "1000")
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "resource_exhausted", None)
    assert "tenant 'alice' has 1 requests in flight" in error["message"]
    stream = await http.post("/v1/completions", json=completion(scripted_gateway, stream=True))
    assert stream.status_code == 429  # refused before the event stream begins
    lorax = await http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert lorax.status_code == 429 and lorax.json()["error_type"] == "overloaded"
    assert (
        await http.post("/v1/completions", json=completion(scripted_gateway), headers=BOB_HTTP)
    ).status_code == 200
    await held.aclose()  # its slot is free again
    assert (await http.post("/v1/completions", json=completion(scripted_gateway))).status_code == 200
    assert scripted_gateway.core.quota.in_flight("alice") == 0


async def test_past_the_concurrency_limit_http_requests_wait_their_turn(scripted_gateway):
    limit_alice(scripted_gateway, max_concurrent_requests=1)  # one running, one waiting
    http = scripted_gateway.http
    held = await hold_a_generation(scripted_gateway)
    waiting = asyncio.create_task(http.post("/v1/completions", json=completion(scripted_gateway)))
    quota = scripted_gateway.core.quota
    while quota.waiting("alice") == 0:
        await asyncio.sleep(0)
    refused = await http.post("/v1/completions", json=completion(scripted_gateway))
    assert refused.status_code == 429 and "max_waiting_requests 1" in refused.json()["error"]["message"]
    assert not waiting.done()
    await held.aclose()  # its slot goes to the waiting request
    answer = await waiting
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    assert quota.in_flight("alice") == 0 and quota.waiting("alice") == 0


async def test_over_the_token_quota_http_answers_429_until_the_window_refills(scripted_gateway):
    clock = limit_alice(scripted_gateway, tokens_per_minute=20)  # a token every 3 s, 20 at most
    http = scripted_gateway.http
    first = await http.post("/v1/completions", json=completion(scripted_gateway))  # 4 + 8 tokens
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] == 12
    refused = await http.post("/v1/completions", json=completion(scripted_gateway))
    assert refused.status_code == 429, refused.text
    # 8 tokens left, 12 asked: 4 more come in 12 s.
    assert (refused.headers["retry-after"], refused.headers["retry-after-ms"]) == ("12", "12000")
    assert "over its quota of 20 tokens per minute" in refused.json()["error"]["message"]
    clock.now += 11.9
    assert (await http.post("/v1/completions", json=completion(scripted_gateway))).status_code == 429
    clock.now += 0.1
    assert (await http.post("/v1/completions", json=completion(scripted_gateway))).status_code == 200
    # Charged what it used: 4 prompt tokens + 2 generated, not 4 + max_tokens 8.
    clock.now += 60
    await http.post("/v1/completions", json=completion(scripted_gateway, max_tokens=2))
    assert scripted_gateway.core.quota.tokens_left("alice") == pytest.approx(14)


# -- the official openai client -----------------------------------------------------------------


@pytest.fixture
def openai_client(scripted_gateway, monkeypatch):
    """``openai.AsyncOpenAI`` (retrying twice) on the scripted gateway's app, as alice, and what it
    saw: every response's status and retry headers, and every wait between retries. Its waits go
    through ``sleep`` (the client's own ``_sleep_for_retry`` and ``Retry-After`` parsing run)."""
    seen = SimpleNamespace(responses=[], waits=[], sleep=None)

    async def record(response: httpx2.Response) -> None:
        seen.responses.append(
            (
                response.status_code,
                response.headers.get("retry-after"),
                response.headers.get("retry-after-ms"),
            )
        )

    async def sleep(seconds: float) -> None:
        seen.waits.append(seconds)
        await seen.sleep(seconds)

    monkeypatch.setattr(openai_base_client, "anyio", SimpleNamespace(sleep=sleep))
    transport = httpx2.ASGITransport(app=build_app(scripted_gateway.parts))
    http_client = httpx2.AsyncClient(transport=transport, event_hooks={"response": [record]})
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key="key-alice", max_retries=2, http_client=http_client
    )
    return client, seen


async def test_the_openai_client_retries_after_retry_after_once_the_window_refills(
    scripted_gateway, openai_client
):
    client, seen = openai_client
    clock = limit_alice(scripted_gateway, tokens_per_minute=20)

    async def sleep(seconds: float) -> None:
        clock.now += seconds

    seen.sleep = sleep
    async with client:
        for _ in range(2):
            answer = await client.completions.create(
                model=scripted_gateway.core.base_model, prompt=[1, 2, 3, 4], max_tokens=8
            )
            assert answer.usage.total_tokens == 12
    assert seen.responses == [(200, None, None), (429, "12", "12000"), (200, None, None)]
    assert seen.waits == [12.0]  # retry-after-ms, to the millisecond


async def test_the_openai_client_retries_once_a_concurrent_request_ends(scripted_gateway, openai_client):
    client, seen = openai_client
    limit_alice(scripted_gateway, max_concurrent_requests=1, max_waiting_requests=0)
    held = await hold_a_generation(scripted_gateway)

    async def sleep(seconds: float) -> None:
        await held.aclose()  # the other request ends while this one waits

    seen.sleep = sleep
    async with client:
        answer = await client.chat.completions.create(
            model=scripted_gateway.core.base_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
    assert answer.choices[0].message.content
    assert seen.responses == [(429, "1", "1000"), (200, None, None)] and seen.waits == [1.0]


# -- limits over gRPC, and the SDK ---------------------------------------------------------------


async def test_over_a_limit_grpc_answers_resource_exhausted_with_retry_after(scripted_gateway, grpc_address):
    clock = limit_alice(
        scripted_gateway, max_concurrent_requests=1, tokens_per_minute=20, max_waiting_requests=0
    )
    request = gateway_pb2.GenerateTextRequest(prompt="Hi", sampling=types_pb2.SamplingParams(max_tokens=8))
    async with aio.insecure_channel(grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        held = await hold_a_generation(scripted_gateway)  # 3 + 4 tokens charged: 13 left
        error = await refusal(lambda: stub.Generate(request, metadata=ALICE))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests in flight" in error.details()
        assert dict(error.trailing_metadata())["retry-after-s"] == "1.000"
        await held.aclose()  # it used 3 + 1 tokens: 16 left
        prompt = len(scripted_gateway.core.encode("Hi"))
        [r async for r in stub.Generate(request, metadata=ALICE)]  # prompt + 8 tokens
        error = await refusal(lambda: stub.Generate(request, metadata=ALICE))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens per minute" in error.details()
        wait_s = float(dict(error.trailing_metadata())["retry-after-s"])
        assert wait_s == pytest.approx((prompt + 8 - (16 - prompt - 8)) * 3, abs=1e-3)
        clock.now += wait_s
        assert [r async for r in stub.Generate(request, metadata=ALICE)][-1].finish_reason


async def test_the_sdk_retries_resource_exhausted_after_its_delay(scripted_gateway, grpc_address, tmp_path):
    clock = limit_alice(scripted_gateway, tokens_per_minute=12)  # a token every 5 s, 12 at most
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds

    no_mesh = tmp_path / "none.json"
    async with AsyncClient(grpc_address, "key-alice", retries=2, sleep=sleep, mesh_file=no_mesh) as client:
        first = await client.generate("Hi", max_tokens=8)
        second = await client.generate("Hi", max_tokens=8)  # refused once, then served
    assert first.text == second.text and len(waits) == 1
    prompt = len(scripted_gateway.core.encode("Hi"))
    delay = (2 * (prompt + 8) - 12) * 5  # the missing tokens, 5 s each
    assert delay <= waits[0] <= delay * 1.1  # never early, at most 10% late
    # Given up: the retries, or a delay over max_retry_after_s.
    async with AsyncClient(
        grpc_address, "key-alice", retries=1, sleep=sleep, max_retry_after_s=1, mesh_file=no_mesh
    ) as client:
        with pytest.raises(ResourceExhausted) as raised:
            await client.generate("Hi", max_tokens=8)
    assert raised.value.retry_after_s > 1 and len(waits) == 1


async def test_the_sync_sdk_retries_once_a_concurrent_request_ends(scripted_gateway, grpc_address, tmp_path):
    limit_alice(scripted_gateway, max_concurrent_requests=1, max_waiting_requests=0)
    held = await hold_a_generation(scripted_gateway)
    loop = asyncio.get_running_loop()
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # in the client's thread
        waits.append(seconds)
        asyncio.run_coroutine_threadsafe(held.aclose(), loop).result(30)

    def generate() -> str:
        with Client(
            grpc_address, "key-alice", retries=2, sleep=sleep, mesh_file=tmp_path / "none.json"
        ) as client:
            return client.generate("Hi", max_tokens=3).text

    assert await asyncio.to_thread(generate)
    assert len(waits) == 1 and 1.0 <= waits[0] <= 1.1
