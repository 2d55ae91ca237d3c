"""Two ways to run the HTTP API on the OpenAI port.

``mesh``: a real mesh (etcd, store, 1 worker, scheduler, gateway), one per test module, with
adapters registered through the SDK (gRPC) and the gateway allowed to load adapter directories
from the tests' temporary tree, which the store's import policy grants alice (not bob).

``scripted_gateway``: a real gateway core, relay and app in this process, in front of a worker
on loopback that answers every request with a scripted list of tokens, and an in-memory store:
for what the HTTP front end itself decides (shapes, mappings, refusals), without a model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc import aio
from support.mesh import Mesh, start_mesh, wait_for_workers

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import Client
from mesh_api.v1 import scheduler_pb2, types_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.core import GatewayCore
from services.gateway.http.app import build_app
from services.gateway.parts import GatewayParts
from services.gateway.relay import Relay
from services.model_files.tokenizer_loading import TokenizerBundle, load_tokenizer
from services.runtime.etcd.discovery import ChannelPool
from services.runtime.metrics import ServiceMetrics
from tests.gateway.in_memory_store import InMemoryStore, gateway_parts


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("openai-adapters")


@pytest.fixture(scope="module")
def adapter_dirs(adapter_root, base_spec):
    """Three small PEFT adapters strong enough to change greedy outputs."""
    return {
        name: write_peft_adapter(
            adapter_root / name, base_spec, SampleAdapterSpec(rank=8, scale=0.04, seed=seed)
        )
        for name, seed in (("pirate", 11), ("french", 12), ("secret", 13))
    }


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, adapter_root, adapter_dirs) -> Mesh:
    """alice owns ``pirate`` and ``french`` (private) ; bob owns ``secret`` (private)."""
    root = tmp_path_factory.mktemp("openai-mesh")
    policy = root / "import-policy.json"
    policy.write_text(json.dumps({"tenants": {"alice": [adapter_root.as_uri()]}}))

    async def start() -> Mesh:
        started = await start_mesh(
            root,
            workers=1,
            gateway_flags=("--adapter-load-dirs", str(adapter_root)),
            store_flags=("--import-policy-file", str(policy)),
        )
        try:
            await wait_for_workers(started, 1)
        except BaseException:
            started.stop()
            raise
        return started

    mesh = asyncio.run(start())
    try:
        with (
            Client(mesh.gateway.address, "key-alice") as alice,
            Client(mesh.gateway.address, "key-bob") as bob,
        ):
            alice.adapters.upload(adapter_dirs["pirate"], "pirate")
            alice.adapters.upload(adapter_dirs["french"], "french")
            bob.adapters.upload(adapter_dirs["secret"], "secret")
        yield mesh
    finally:
        mesh.stop()


# -- in process, with a scripted worker --------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_bundle() -> TokenizerBundle:
    return load_tokenizer()


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Answers every request with the tokens of ``script`` as an engine would: one per reply,
    each with a log-probability (``-1 - i``) and up to ``top_logprobs`` alternatives (itself
    first, then ids 1, 2...) when asked for; it stops after an end-of-sequence token unless
    ``ignore_eos`` (STOP), at ``max_tokens`` or at the script's end (LENGTH, on the last token
    or on a reply of its own), unless it is set to refuse. Every request is recorded."""

    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = eos_token_ids
        self.script: list[int] = []
        self.fail_after: int | None = None
        """Set: the stream fails UNAVAILABLE after this many tokens (the worker went away)."""
        self.end_without_token = False
        """The script's end is a last reply with no token (a worker whose pool is full)."""
        self.refusal: str | None = None
        """Set: every request is refused INVALID_ARGUMENT with this message (a schema the worker
        cannot compile)."""
        self.requests: list[worker_pb2.GenerateRequest] = []

    async def Generate(self, request: worker_pb2.GenerateRequest, context):
        self.requests.append(request)
        if self.refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refusal)
        sampling = request.sampling
        tokens = self.script[: sampling.max_tokens]
        for i, token in enumerate(tokens):
            if i == self.fail_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
            reply = worker_pb2.GenerateResponse(token_ids=[token])
            if sampling.HasField("top_logprobs"):
                top = [token, *range(1, sampling.top_logprobs)][: sampling.top_logprobs]
                reply.logprobs.append(
                    types_pb2.TokenLogprobs(
                        logprob=-1.0 - i,
                        top_token_ids=top,
                        top_logprobs=[-1.0 - i - j for j in range(len(top))],
                    )
                )
            if token in self.eos_token_ids and not sampling.ignore_eos:
                reply.finish_reason = types_pb2.FINISH_REASON_STOP
            elif i == len(tokens) - 1 and not self.end_without_token:
                reply.finish_reason = types_pb2.FINISH_REASON_LENGTH
            yield reply
            if reply.finish_reason:
                return
        yield worker_pb2.GenerateResponse(finish_reason=types_pb2.FINISH_REASON_LENGTH)


@dataclass
class ScriptedGateway:
    parts: GatewayParts
    worker: ScriptedWorker
    metrics: ServiceMetrics
    http: httpx.AsyncClient
    """The app on the HTTP port, authenticated as alice."""
    store: InMemoryStore
    """The adapters the gateway finds (a test may add some before it names them)."""

    @property
    def core(self) -> GatewayCore:
        return self.parts.core


#: alice's private ``pirate``; bob's private ``secret`` and public ``shared``.
SCRIPTED_ADAPTERS = [
    types_pb2.AdapterInfo(id="a1", name="pirate", owner="alice", visibility=types_pb2.VISIBILITY_PRIVATE,
                          created_unix_ms=1_700_000_000_000),
    types_pb2.AdapterInfo(id="b1", name="secret", owner="bob", visibility=types_pb2.VISIBILITY_PRIVATE),
    types_pb2.AdapterInfo(id="b2", name="shared", owner="bob", visibility=types_pb2.VISIBILITY_PUBLIC),
]  # fmt: skip


@pytest.fixture
async def scripted_gateway(tokenizer_bundle) -> AsyncIterator[ScriptedGateway]:
    worker = ScriptedWorker(tuple(tokenizer_bundle.tokenizer.eos_token_ids))
    worker_server = aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, worker_server)
    worker_address = f"127.0.0.1:{worker_server.add_insecure_port('127.0.0.1:0')}"
    await worker_server.start()

    async def place(request: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        return scheduler_pb2.PlaceResponse(worker_id="w1", address=worker_address)

    channels = ChannelPool()
    store = InMemoryStore(list(SCRIPTED_ADAPTERS))
    relay = Relay(place, channels, max_resumes=0)
    parts = gateway_parts("key-alice=alice,key-bob=bob", store, tokenizer_bundle, relay)
    metrics = ServiceMetrics("gateway")
    transport = httpx.ASGITransport(app=build_app(parts, metrics))
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gateway", headers={"authorization": "Bearer key-alice"}
        ) as http:
            yield ScriptedGateway(parts, worker, metrics, http, store)
    finally:
        await parts.catalog.stop()
        await channels.close()
        await worker_server.stop(None)
