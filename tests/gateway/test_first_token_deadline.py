"""A request's first-token deadline travels from the SDK (``deadline_ms``) and the OpenAI body
(``first_token_deadline_ms``) through the gateway to the worker's GenerateRequest, less the time
the gateway spent placing it: a real gateway core and relay in front of a recording worker on
loopback, with the relay's clock advanced by the fake placement only (never by real time). Bad
values are refused naming the field, as INVALID_ARGUMENT over gRPC and a 400 over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc import aio

from loramesh import AsyncClient
from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, types_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.http.app import build_app
from services.gateway.parts import GatewayParts
from services.gateway.relay import MIN_WORKER_DEADLINE_MS, Relay
from services.gateway.servicer import GatewayServicer
from services.model_files.tokenizer_loading import TokenizerBundle, load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.rpc.interceptors import ServiceInterceptor
from tests.gateway.in_memory_store import InMemoryStore, gateway_parts

KEYS = "key-alice=alice"
ALICE = (("authorization", "Bearer key-alice"),)
PLACEMENT_S = 0.1
"""What each placement costs on the relay's fake clock."""


@pytest.fixture(scope="module")
def text() -> TokenizerBundle:
    return load_tokenizer()


class RecordingWorker(worker_pb2_grpc.WorkerServicer):
    """Answers one token per request (``max_tokens`` 1 ends it), recording each request. The
    first ``fail_before_token`` calls fail UNAVAILABLE at once; the first ``fail_after_token``
    calls after those send their token and then fail."""

    def __init__(self, token: int):
        self.token = token
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.fail_before_token = 0
        self.fail_after_token = 0

    async def Generate(self, request: worker_pb2.GenerateRequest, context):
        self.requests.append(request)
        if self.fail_before_token:
            self.fail_before_token -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
        if self.fail_after_token:
            self.fail_after_token -= 1
            yield worker_pb2.GenerateResponse(token_ids=[self.token])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
        yield worker_pb2.GenerateResponse(
            token_ids=[self.token], finish_reason=types_pb2.FINISH_REASON_LENGTH
        )


@dataclass
class Gateway:
    parts: GatewayParts
    worker: RecordingWorker
    stub: gateway_pb2_grpc.GatewayStub
    address: str
    places: list[scheduler_pb2.PlaceRequest]


@pytest.fixture
async def gateway(text) -> AsyncIterator[Gateway]:
    worker = RecordingWorker(text.tokenizer.encode(" hello")[0])
    worker_server = aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, worker_server)
    worker_address = f"127.0.0.1:{worker_server.add_insecure_port('127.0.0.1:0')}"
    await worker_server.start()

    now = [1000.0]
    places: list[scheduler_pb2.PlaceRequest] = []

    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        places.append(request)
        now[0] += PLACEMENT_S
        return scheduler_pb2.PlaceResponse(worker_id="w1", address=worker_address)

    channels = ChannelPool()
    relay = Relay(place, channels, max_resumes=3, clock=lambda: now[0])
    parts = gateway_parts(KEYS, InMemoryStore(), text, relay)
    server = aio.server(interceptors=[ServiceInterceptor()])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(parts), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with aio.insecure_channel(address) as channel:
            yield Gateway(parts, worker, gateway_pb2_grpc.GatewayStub(channel), address, places)
    finally:
        await server.stop(None)
        await channels.close()
        await worker_server.stop(None)


def generate(deadline_ms: float) -> gateway_pb2.GenerateTextRequest:
    return gateway_pb2.GenerateTextRequest(
        prompt="Say hello:",
        sampling=types_pb2.SamplingParams(max_tokens=1),
        first_token_deadline_ms=deadline_ms,
    )


async def run(gateway: Gateway, request) -> list[gateway_pb2.GenerateTextResponse]:
    return [reply async for reply in gateway.stub.Generate(request, metadata=ALICE)]


async def test_the_worker_gets_what_is_left_of_the_deadline_after_placement(gateway):
    await run(gateway, generate(250))
    assert gateway.places[0].first_token_deadline_ms == 250  # the scheduler gets the whole deadline
    assert gateway.worker.requests[0].first_token_deadline_ms == pytest.approx(250 - PLACEMENT_S * 1000)


async def test_no_deadline_reaches_the_worker_as_zero_its_own_slo(gateway):
    await run(gateway, generate(0))
    assert gateway.worker.requests[0].first_token_deadline_ms == 0


async def test_a_spent_deadline_reaches_the_worker_as_the_smallest_one_not_as_none(gateway):
    await run(gateway, generate(60))  # 100 ms of placement: 40 ms past it
    assert gateway.worker.requests[0].first_token_deadline_ms == MIN_WORKER_DEADLINE_MS


async def test_a_resume_before_the_first_token_carries_less_and_after_it_none(gateway):
    gateway.worker.fail_before_token = 1
    await run(gateway, generate(1000))
    assert [r.first_token_deadline_ms for r in gateway.worker.requests] == pytest.approx([900, 800])

    gateway.worker.requests.clear()
    gateway.worker.fail_after_token = 1
    await run(gateway, gateway_pb2.GenerateTextRequest(
        prompt="Say hello:", sampling=types_pb2.SamplingParams(max_tokens=2), first_token_deadline_ms=1000
    ))  # fmt: skip
    assert [r.first_token_deadline_ms for r in gateway.worker.requests] == pytest.approx([900, 0])


async def test_the_sdk_deadline_reaches_the_worker(gateway):
    async with AsyncClient(gateway.address, "key-alice") as client:
        await client.generate("Say hello:", max_tokens=1, deadline_ms=500)
        await client.chat([("user", "Say hello")], max_tokens=1, deadline_ms=300)
    assert [r.first_token_deadline_ms for r in gateway.worker.requests] == pytest.approx([400, 200])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
async def test_a_bad_grpc_deadline_is_invalid_argument_naming_the_field(gateway, bad):
    with pytest.raises(aio.AioRpcError) as refused:
        await run(gateway, generate(bad))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first_token_deadline_ms" in refused.value.details()
    assert gateway.places == [] and gateway.worker.requests == []


async def post(gateway: Gateway, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(gateway.parts))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return await client.post(path, json=body, headers={"authorization": "Bearer key-alice"})


async def test_the_openai_extension_field_reaches_the_worker(gateway):
    base = gateway.parts.core.base_model
    completion = {"model": base, "prompt": "Say hello:", "max_tokens": 1, "first_token_deadline_ms": 250}
    assert (await post(gateway, "/v1/completions", completion)).status_code == 200
    chat = {"model": base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "first_token_deadline_ms": 700}  # fmt: skip
    assert (await post(gateway, "/v1/chat/completions", chat)).status_code == 200
    plain = {"model": base, "prompt": "Say hello:", "max_tokens": 1}
    assert (await post(gateway, "/v1/completions", plain)).status_code == 200
    assert [r.first_token_deadline_ms for r in gateway.worker.requests] == pytest.approx([150, 600, 0])
    assert [p.first_token_deadline_ms for p in gateway.places] == [250, 700, 0]


@pytest.mark.parametrize("bad", [-5, "soon", True, [250]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_bad_openai_deadline_is_a_400_naming_the_field(gateway, bad, path):
    body = {"model": gateway.parts.core.base_model, "max_tokens": 1, "first_token_deadline_ms": bad}
    body.update(
        {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    reply = await post(gateway, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "first_token_deadline_ms" and "first_token_deadline_ms" in error["message"]
    assert gateway.places == []
