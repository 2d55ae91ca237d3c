"""Continuations through a real gateway over gRPC: its servicer, core, relay and interceptor on
loopback, with the SmolLM2 tokenizer, in front of a scripted worker (no model): the worker
streams a fixed token sequence from wherever the prompt it is sent leaves off, so the gateway's
own part is what is checked. A request continued after any message gives exactly the rest of
the undisturbed stream (tokens, text, finish reason, usage); bad continuations are refused
naming the field; the SDK failing over from a gateway that stops mid-stream continues on the
other gateway."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc import aio

from loramesh import AsyncClient
from mesh_api.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, types_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.core import GatewayCore
from services.gateway.relay import Relay
from services.gateway.servicer import GatewayServicer
from services.model_files.tokenizer_loading import TokenizerBundle, load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.rpc.interceptors import ServiceInterceptor
from tests.gateway.in_memory_store import InMemoryStore, gateway_parts

KEYS = "key-alice=alice,key-bob=bob"
ALICE = (("authorization", "Bearer key-alice"),)
PROMPT = "Tell me something:"
# "C|af|é| 🎉 split over three tokens| —| na|ïve| ST|OP|P|ED| here", then the end-of-sequence token.
SCRIPT_TEXT = "Café 🎉 — naïve STOPPED here"


@pytest.fixture(scope="module")
def text() -> TokenizerBundle:
    return load_tokenizer()


@pytest.fixture(scope="module")
def script(text) -> list[int]:
    return [*text.tokenizer.encode(SCRIPT_TEXT), *text.tokenizer.eos_token_ids[:1]]


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Generates ``script`` after ``prompt_ids``: a request's prompt must be ``prompt_ids`` plus
    a prefix of the script, and it streams the script on from there, one token per reply,
    ending on a stop token (STOP) or at ``max_tokens`` (LENGTH). With ``hold_at`` set it waits
    for ``release`` before sending the script's token at that index."""

    def __init__(self, script: list[int], eos_token_ids: tuple[int, ...]):
        self.script = script
        self.eos = frozenset(eos_token_ids)
        self.prompt_ids: list[int] = []
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.hold_at: int | None = None
        self.release = asyncio.Event()

    async def Generate(self, request: worker_pb2.GenerateRequest, context):
        self.requests.append(request)
        prompt = list(request.prompt_token_ids)
        start = len(prompt) - len(self.prompt_ids)
        assert prompt == self.prompt_ids + self.script[:start], "the gateway sent prompt + delivered tokens"
        sampling = request.sampling
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos)
        for n, token in enumerate(self.script[start:], 1):
            if start + n - 1 == self.hold_at:
                await self.release.wait()
            finish = (
                types_pb2.FINISH_REASON_STOP
                if token in stops
                else types_pb2.FINISH_REASON_LENGTH
                if n == sampling.max_tokens
                else types_pb2.FINISH_REASON_UNSPECIFIED
            )
            yield worker_pb2.GenerateResponse(token_ids=[token], finish_reason=finish)
            if finish:
                return


PRIVATE_ADAPTERS = [
    types_pb2.AdapterInfo(id="id-secret", name="secret", owner="bob"),
    types_pb2.AdapterInfo(id="tuned-1", name="tuned", owner="alice", version=1, sha256="11" * 32),
]


@dataclass
class Gateway:
    core: GatewayCore
    server: aio.Server
    address: str
    channels: ChannelPool
    """Its relay's channels to the worker."""
    store: InMemoryStore


async def serve_gateway(text: TokenizerBundle, worker_address: str) -> Gateway:
    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        return scheduler_pb2.PlaceResponse(worker_id="scripted", address=worker_address)

    channels = ChannelPool()
    relay = Relay(place, channels, max_resumes=1)
    store = InMemoryStore(list(PRIVATE_ADAPTERS))
    parts = gateway_parts(KEYS, store, text, relay)
    server = aio.server(interceptors=[ServiceInterceptor()])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(parts), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Gateway(parts.core, server, f"127.0.0.1:{port}", channels, store)


@dataclass
class Mesh:
    worker: ScriptedWorker
    gateways: list[Gateway]
    stub: gateway_pb2_grpc.GatewayStub
    """Of the first gateway."""


@pytest.fixture
async def mesh(text, script) -> AsyncIterator[Mesh]:
    worker = ScriptedWorker(script, text.tokenizer.eos_token_ids)
    worker.prompt_ids = text.tokenizer.encode(PROMPT)
    worker_server = aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, worker_server)
    worker_address = f"127.0.0.1:{worker_server.add_insecure_port('127.0.0.1:0')}"
    await worker_server.start()
    gateways = [await serve_gateway(text, worker_address) for _ in range(2)]
    async with aio.insecure_channel(gateways[0].address) as channel:
        yield Mesh(worker, gateways, gateway_pb2_grpc.GatewayStub(channel))
    for gateway in gateways:
        await gateway.server.stop(None)
        await gateway.channels.close()
    await worker_server.stop(None)


def generate(sampling: types_pb2.SamplingParams, **fields) -> gateway_pb2.GenerateTextRequest:
    return gateway_pb2.GenerateTextRequest(prompt=PROMPT, sampling=sampling, **fields)


def continuation(messages: list[gateway_pb2.GenerateTextResponse]) -> gateway_pb2.Continuation:
    return gateway_pb2.Continuation(
        token_ids=[t for m in messages for t in m.token_ids], text="".join(m.text for m in messages)
    )


async def stream(stub, method: str, request) -> list[gateway_pb2.GenerateTextResponse]:
    return [m async for m in getattr(stub, method)(request, metadata=ALICE)]


def whole(messages: list[gateway_pb2.GenerateTextResponse]) -> tuple:
    last = messages[-1]
    return (
        continuation(messages),
        last.finish_reason,
        last.usage.prompt_tokens,
        last.usage.completion_tokens,
    )


ENDINGS = {
    "a stop string spanning tokens": types_pb2.SamplingParams(max_tokens=64, stop_strings=["TOPPE"]),
    "the end-of-sequence token": types_pb2.SamplingParams(max_tokens=64),
    "max_tokens": types_pb2.SamplingParams(max_tokens=9),
}


@pytest.mark.parametrize("ending", ENDINGS)
async def test_a_continuation_after_any_message_gives_exactly_the_rest(mesh, script, ending):
    sampling = ENDINGS[ending]
    undisturbed = await stream(mesh.stub, "Generate", generate(sampling))
    assert len(undisturbed) > 5 and undisturbed[-1].finish_reason
    for cut in range(len(undisturbed) + 1):
        asked = len(mesh.worker.requests)
        delivered = continuation(undisturbed[:cut])
        rest = await stream(mesh.stub, "Generate", generate(sampling, continuation=delivered))
        assert whole(undisturbed[:cut] + rest) == whole(undisturbed), f"continued after {cut} messages"
        if cut == len(undisturbed):  # everything was delivered: it ends at once, no worker asked
            assert len(rest) == 1 and not rest[0].token_ids and len(mesh.worker.requests) == asked
        else:  # one token per message
            sent = mesh.worker.requests[-1]
            assert list(sent.prompt_token_ids) == mesh.worker.prompt_ids + script[:cut]
            assert sent.sampling.max_tokens == sampling.max_tokens - cut


async def test_a_chat_continues_the_same_way(mesh):
    messages = [gateway_pb2.ChatMessage(role="user", content="Say something.")]
    mesh.worker.prompt_ids = await mesh.gateways[0].core.chat_prompt("alice", [("user", "Say something.")])
    sampling = types_pb2.SamplingParams(max_tokens=64)
    undisturbed = await stream(
        mesh.stub, "Chat", gateway_pb2.ChatRequest(messages=messages, sampling=sampling)
    )
    request = gateway_pb2.ChatRequest(
        messages=messages, sampling=sampling, continuation=continuation(undisturbed[:4])
    )
    rest = await stream(mesh.stub, "Chat", request)
    assert whole(undisturbed[:4] + rest) == whole(undisturbed)


async def refused(stub, request, metadata=ALICE) -> aio.AioRpcError:
    with pytest.raises(aio.AioRpcError) as error:
        [m async for m in stub.Generate(request, metadata=metadata)]
    return error.value


@pytest.mark.parametrize(
    "delivered, field",
    [
        (gateway_pb2.Continuation(token_ids=[51, 10**6], text="C"), "continuation.token_ids[1] is 1000000"),
        (gateway_pb2.Continuation(token_ids=[51] * 5, text="CCCCC"), "more than sampling.max_tokens 4"),
        (gateway_pb2.Continuation(token_ids=[51, 1939], text="Caf!"), "continuation.text is not the text"),
        (gateway_pb2.Continuation(token_ids=[51, 2, 51], text="CC"), "continuation.token_ids[1] ended"),
    ],
    ids=["out of the vocabulary", "over max_tokens", "other text", "after the end"],
)
async def test_bad_continuations_are_invalid_arguments_naming_the_field(mesh, delivered, field):
    error = await refused(mesh.stub, generate(types_pb2.SamplingParams(max_tokens=4), continuation=delivered))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details()
    assert not mesh.worker.requests


async def test_a_continuation_is_authenticated_and_authorized_as_any_request(mesh):
    delivered = gateway_pb2.Continuation(token_ids=[51], text="C")
    request = generate(types_pb2.SamplingParams(max_tokens=4), continuation=delivered)
    error = await refused(mesh.stub, request, metadata=(("authorization", "Bearer forged"),))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    request.adapter = "bob/secret"  # private: as if it did not exist
    error = await refused(mesh.stub, request)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert not mesh.worker.requests


async def test_the_sdk_continues_on_the_other_gateway_when_its_gateway_stops_mid_stream(
    mesh, script, tmp_path
):
    sampling = {"max_tokens": 64, "stop": ["TOPPE"]}
    addresses = [g.address for g in mesh.gateways]
    no_mesh = tmp_path / "no-mesh.json"
    async with AsyncClient(addresses, "key-alice", retries=3, backoff_s=0.01, mesh_file=no_mesh) as sdk:
        undisturbed = [d async for d in sdk.stream(PROMPT, **sampling)]
        mesh.worker.hold_at = 5  # inside the emoji: its first tokens are delivered, its text held
        deltas = []
        async with contextlib.aclosing(sdk.stream(PROMPT, **sampling)) as stream_:
            async for delta in stream_:
                deltas.append(delta)
                if sum(len(d.token_ids) for d in deltas) == 5:
                    await mesh.gateways[0].server.stop(0)  # the first gateway goes away mid-stream
                    mesh.worker.release.set()
        assert sdk.failovers == 1
    assert "".join(d.text for d in deltas) == "".join(d.text for d in undisturbed) == "Café 🎉 — naïve S"
    assert [t for d in deltas for t in d.token_ids] == [t for d in undisturbed for t in d.token_ids]
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage.completion_tokens == undisturbed[-1].usage.completion_tokens
    continued = mesh.worker.requests[-1]
    assert list(continued.prompt_token_ids) == mesh.worker.prompt_ids + script[:5]


async def test_a_stream_the_sdk_continues_keeps_the_adapter_version_that_served_it(mesh, tmp_path):
    addresses = [g.address for g in mesh.gateways]
    no_mesh = tmp_path / "no-mesh.json"
    newer = types_pb2.AdapterInfo(id="tuned-2", name="tuned", owner="alice", version=2, sha256="22" * 32)
    async with AsyncClient(addresses, "key-alice", retries=3, backoff_s=0.01, mesh_file=no_mesh) as sdk:
        mesh.worker.hold_at = 5
        deltas = []
        async with contextlib.aclosing(sdk.stream(PROMPT, adapter="tuned", max_tokens=64)) as stream_:
            async for delta in stream_:
                deltas.append(delta)
                if sum(len(d.token_ids) for d in deltas) == 5:
                    for gateway in mesh.gateways:  # version 2 is published while the stream is open
                        gateway.store.adapters.append(newer)
                    await mesh.gateways[0].server.stop(0)
                    mesh.worker.release.set()
        assert sdk.failovers == 1
    assert deltas[0].served_by.fingerprint == "tuned@1 sha256:111111111111"
    # The other gateway continued it on version 1 (asked for as tuned@1), not on the newest.
    assert [r.adapter_id for r in mesh.worker.requests] == ["tuned-1", "tuned-1"]
