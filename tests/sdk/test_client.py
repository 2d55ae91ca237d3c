"""The SDK against a real grpc.aio server on loopback serving a small fake ``loramesh.v1.Gateway``.

The fake checks the API key, streams canned deltas (continuing after a request's
``continuation`` as the real gateway does), fails with any status on demand (a prompt
``status:<CODE>``), fails the first N calls with UNAVAILABLE, breaks a stream after each delta
(prompt ``break``) or stalls (prompt ``slow``). The real gateway is tested elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio

import loramesh
from loramesh import (
    AlreadyExists,
    AsyncClient,
    Client,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    LoraMeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StreamInterrupted,
    Unauthenticated,
    Unavailable,
)
from loramesh.client import STATE_DIR_ENV, RetryNotice, resolve_targets
from loramesh.errors import NoGatewayAddress
from loramesh.retry import CallPolicy
from loramesh.tls import ClientTLS
from mesh_api.upload_wire import UPLOAD_CHUNK_BYTES
from mesh_api.v1 import adapter_store_pb2, gateway_pb2, gateway_pb2_grpc, types_pb2

API_KEY = "sk-test"
TENANT = "acme"
DELTAS = ("Hello", ", ", "world")
GENERATION_ID = "gen-1"


@dataclass
class Received:
    """One call as the fake gateway saw it."""

    method: str
    request: object
    metadata: dict[str, str]


@dataclass
class Upload:
    header: adapter_store_pb2.RegisterAdapterRequest.Header
    files: dict[str, bytes]
    chunks: int


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """A scriptable gateway; tests set ``unavailable_first`` and read ``received``/``uploads``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.unavailable_first = 0
        """Calls still to fail with UNAVAILABLE."""
        self.break_streams = False
        """Every stream fails with UNAVAILABLE after its first delta (a gateway that dies)."""
        self.received: list[Received] = []
        self.uploads: list[Upload] = []
        self.adapters = [
            types_pb2.AdapterInfo(id=f"id-{i}", name=f"a{i}", owner=TENANT, rank=8) for i in range(5)
        ]

    def calls(self, method: str) -> list[Received]:
        return [r for r in self.received if r.method == method]

    async def _admit(self, method: str, request, context: aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata())
        self.received.append(Received(method, request, metadata))
        context.set_trailing_metadata((("x-request-id", metadata.get("x-request-id", "")),))
        if metadata.get("authorization") != f"Bearer {API_KEY}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        if self.unavailable_first > 0:
            self.unavailable_first -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is starting")

    async def _deltas(
        self, prompt: str, continuation: gateway_pb2.Continuation, context: aio.ServicerContext
    ):
        if prompt.startswith("status:"):
            code = grpc.StatusCode[prompt.removeprefix("status:")]
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                request_id = dict(context.invocation_metadata())["x-request-id"]
                context.set_trailing_metadata((("x-request-id", request_id), ("retry-after-s", "1.500")))
            await context.abort(code, f"scripted {code.name}")
        if prompt == "slow":
            await asyncio.Event().wait()  # never answers: only the caller's deadline ends the call
        delivered = len(continuation.token_ids)
        assert list(continuation.token_ids) == [10 + i for i in range(delivered)]
        assert continuation.text == "".join(DELTAS[:delivered])
        for i, text in enumerate(DELTAS[delivered:], delivered):
            last = i == len(DELTAS) - 1
            yield gateway_pb2.GenerateTextResponse(
                text=text,
                token_ids=[10 + i],
                request_id=GENERATION_ID,
                finish_reason=types_pb2.FINISH_REASON_STOP if last else types_pb2.FINISH_REASON_UNSPECIFIED,
                usage=gateway_pb2.Usage(
                    prompt_tokens=4, completion_tokens=3, first_token_ms=1.5, total_ms=3.0
                )
                if last
                else None,
            )
            if prompt == "break" or self.break_streams:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")

    async def Generate(self, request, context):
        await self._admit("Generate", request, context)
        async for message in self._deltas(request.prompt, request.continuation, context):
            yield message

    async def Chat(self, request, context):
        await self._admit("Chat", request, context)
        async for message in self._deltas(request.messages[-1].content, request.continuation, context):
            yield message

    async def UploadAdapter(self, request_iterator, context):
        # Read the whole stream before answering: a status sent while the client is still
        # writing races its writes, and grpc then reports INTERNAL to the client instead.
        header, files, chunks = None, {}, 0
        async for message in request_iterator:
            if message.WhichOneof("item") == "header":
                header = message.header
            else:
                files[message.chunk.filename] = files.get(message.chunk.filename, b"") + message.chunk.data
                chunks += 1
        await self._admit("UploadAdapter", None, context)
        self.uploads.append(Upload(header, files, chunks))
        weights = files.get("adapter_model.safetensors", b"")
        return adapter_store_pb2.RegisterAdapterResponse(
            adapter=types_pb2.AdapterInfo(
                id="id-new",
                name=header.name,
                owner=TENANT,
                visibility=header.visibility,
                size_bytes=len(weights),
                sha256=hashlib.sha256(weights).hexdigest(),
            )
        )

    async def ListAdapters(self, request, context):
        await self._admit("ListAdapters", request, context)
        start = int(request.page_token or 0)
        end = start + (request.page_size or 100)
        return adapter_store_pb2.ListAdaptersResponse(
            adapters=self.adapters[start:end],
            next_page_token=str(end) if end < len(self.adapters) else "",
            total=len(self.adapters),
        )

    async def GetAdapter(self, request, context):
        await self._admit("GetAdapter", request, context)
        for adapter in self.adapters:
            if adapter.name == request.adapter:
                return adapter
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter {request.adapter!r}")

    async def DeleteAdapter(self, request, context):
        await self._admit("DeleteAdapter", request, context)
        return adapter_store_pb2.DeleteAdapterResponse(adapter=self.adapters[0])

    async def ListModels(self, request, context):
        await self._admit("ListModels", request, context)
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelInfo(id="", base_model="smollm2", is_base=True),
                gateway_pb2.ModelInfo(
                    id="bob/pub",
                    owner="bob",
                    base_model="smollm2",
                    rank=16,
                    visibility=types_pb2.VISIBILITY_PUBLIC,
                ),
            ]
        )


class ServerThread:
    """The fake gateway served by grpc.aio on its own event loop thread (sync tests can call it)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway = FakeGateway()
        self.server, port = self._run(self._start())
        self.address = f"127.0.0.1:{port}"

    async def _start(self):
        server = aio.server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.gateway, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server():
    running = ServerThread()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server_b():
    """A second gateway, for failover."""
    running = ServerThread()
    yield running
    running.stop()


@pytest.fixture
def gateway_b(server_b) -> FakeGateway:
    server_b.gateway.reset()
    return server_b.gateway


@pytest.fixture
def gateway(server) -> FakeGateway:
    """The fake gateway, its script and records reset for the test."""
    server.gateway.reset()
    return server.gateway


@pytest.fixture
def no_mesh(tmp_path) -> Path:
    return tmp_path / "no-mesh.json"


@pytest.fixture
def client(server, gateway, no_mesh):
    with Client(server.address, API_KEY, retries=3, backoff_s=0.01, mesh_file=no_mesh) as c:
        yield c


@pytest.fixture
async def aclient(server, gateway, no_mesh):
    async with AsyncClient(server.address, API_KEY, retries=3, backoff_s=0.01, mesh_file=no_mesh) as c:
        yield c


SAMPLING = {
    "max_tokens": 32,
    "temperature": 0.7,
    "top_k": 40,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "seed": 1234,
    "stop": ["\n\n"],
    "stop_token_ids": [2, 3],
    "deadline_ms": 250.0,
}

STATUSES = [
    ("INVALID_ARGUMENT", InvalidArgument),
    ("NOT_FOUND", NotFound),
    ("ALREADY_EXISTS", AlreadyExists),
    ("PERMISSION_DENIED", PermissionDenied),
    ("UNAUTHENTICATED", Unauthenticated),
    ("RESOURCE_EXHAUSTED", ResourceExhausted),
    ("UNAVAILABLE", Unavailable),
    ("DEADLINE_EXCEEDED", DeadlineExceeded),
    ("FAILED_PRECONDITION", FailedPrecondition),
    ("DATA_LOSS", DataLoss),
    ("INTERNAL", InternalError),
    ("CANCELLED", LoraMeshError),
]


def check_sampling_sent(received: Received, adapter: str) -> None:
    request = received.request
    assert request.adapter == adapter
    s = request.sampling
    assert (s.max_tokens, s.top_k, s.seed) == (32, 40, 1234)
    assert (s.temperature, s.top_p, s.repetition_penalty) == pytest.approx((0.7, 0.9, 1.1))
    assert list(s.stop_strings) == ["\n\n"] and list(s.stop_token_ids) == [2, 3]
    assert request.first_token_deadline_ms == 250.0
    assert received.metadata["authorization"] == f"Bearer {API_KEY}"
    assert len(received.metadata["x-request-id"]) == 16


def check_completion(result: loramesh.Completion) -> None:
    assert result.text == "Hello, world"
    assert result.token_ids == (10, 11, 12)
    assert result.finish_reason == "stop"
    assert result.usage == loramesh.Usage(
        prompt_tokens=4, completion_tokens=3, first_token_ms=1.5, total_ms=3.0, resumes=0
    )
    assert result.request_id == GENERATION_ID


def check_deltas(deltas: list[loramesh.TextDelta]) -> None:
    assert tuple(d.text for d in deltas) == DELTAS
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert deltas[0].usage is None and deltas[-1].usage.completion_tokens == 3


def check_status(
    error: LoraMeshError, code: str, expected: type[LoraMeshError], gateway: FakeGateway
) -> None:
    assert type(error) is expected
    assert error.code == code
    assert error.details == f"scripted {code}"
    assert error.request_id == gateway.received[0].metadata["x-request-id"]
    if expected is ResourceExhausted:
        assert error.retry_after_s == 1.5


def write_adapter(directory: Path) -> dict[str, bytes]:
    """A fake PEFT directory whose weights span three upload chunks (the fake does not validate)."""
    directory.mkdir()
    files = {
        "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 8}).encode(),
        "adapter_model.safetensors": bytes(range(256)) * (UPLOAD_CHUNK_BYTES * 5 // 2 // 256 + 7),
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


def check_upload(gateway: FakeGateway, files: dict[str, bytes], adapter: loramesh.Adapter) -> None:
    (upload,) = gateway.uploads
    assert upload.header.name == "mine" and upload.header.owner == ""
    assert upload.header.visibility == types_pb2.VISIBILITY_PUBLIC
    assert upload.header.total_bytes == sum(len(d) for d in files.values())
    assert upload.files == files
    assert upload.chunks == 4  # the config, then the weights (2.5 chunks' worth) in three
    assert adapter.name == "mine" and adapter.public and adapter.owner == TENANT
    assert adapter.sha256 == hashlib.sha256(files["adapter_model.safetensors"]).hexdigest()


# --- the sync client ----------------------------------------------------------------------


def test_generate_sends_the_request_and_joins_the_stream(client, gateway):
    check_completion(client.generate("Once upon", adapter="bob/pub", **SAMPLING))
    (received,) = gateway.calls("Generate")
    assert received.request.prompt == "Once upon"
    check_sampling_sent(received, "bob/pub")


def test_defaults_leave_sampling_to_the_server(client, gateway):
    client.generate("Hi")
    request = gateway.calls("Generate")[0].request
    assert request.adapter == "" and not request.sampling.HasField("seed")
    assert request.sampling == types_pb2.SamplingParams()


def test_ignore_eos_is_sent_only_when_asked(client, gateway):
    client.generate("Hi", max_tokens=4, ignore_eos=True)
    client.generate("Hi", max_tokens=4)
    first, second = (call.request.sampling for call in gateway.calls("Generate"))
    assert first.ignore_eos and not second.ignore_eos


def test_stream_yields_each_delta(client):
    check_deltas(list(client.stream("Hi", max_tokens=3)))


def test_chat_takes_dicts_and_tuples(client, gateway):
    messages = [{"role": "system", "content": "Be brief."}, ("user", "Hi")]
    check_completion(client.chat(messages, adapter="a1", **SAMPLING))
    check_deltas(list(client.chat_stream(messages)))
    request = gateway.calls("Chat")[0].request
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hi")]
    check_sampling_sent(gateway.calls("Chat")[0], "a1")
    with pytest.raises(TypeError):
        client.chat(["Hi"])


@pytest.mark.parametrize("code, expected", STATUSES)
def test_each_status_maps_to_its_exception(server, gateway, no_mesh, code, expected):
    with (
        Client(server.address, API_KEY, retries=0, mesh_file=no_mesh) as client,
        pytest.raises(LoraMeshError) as raised,
    ):
        client.generate(f"status:{code}")
    check_status(raised.value, code, expected, gateway)


def test_wrong_api_key_is_unauthenticated(server, gateway, no_mesh):
    with Client(server.address, "sk-wrong", mesh_file=no_mesh) as client, pytest.raises(Unauthenticated):
        client.models()


def test_unavailable_is_retried_with_the_same_request_id(client, gateway):
    gateway.unavailable_first = 2
    check_completion(client.generate("Hi"))
    calls = gateway.calls("Generate")
    assert len(calls) == 3
    assert len({c.metadata["x-request-id"] for c in calls}) == 1
    gateway.unavailable_first = 1
    assert client.models()[0].is_base
    assert len(gateway.calls("ListModels")) == 2


def test_unavailable_forever_raises_after_the_retries(client, gateway):
    gateway.unavailable_first = 100
    with pytest.raises(Unavailable):
        client.generate("Hi")
    assert len(gateway.calls("Generate")) == 1 + 3
    assert client.failovers == 3  # the last failure was not retried


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7}, {"temperature": 0.7, "seed": 3}])
def test_a_stream_broken_after_every_delta_is_continued_after_what_it_yielded(client, gateway, sampling):
    deltas = list(client.stream("break", **sampling))
    check_deltas(deltas)
    first, second, third = (call.request for call in gateway.calls("Generate"))
    assert not first.HasField("continuation")
    assert (list(second.continuation.token_ids), second.continuation.text) == ([10], "Hello")
    assert (list(third.continuation.token_ids), third.continuation.text) == ([10, 11], "Hello, ")
    assert third.prompt == first.prompt and third.sampling == first.sampling
    # Broken after its last delta too: the answer is whole, so that break is not retried.
    assert client.failovers == 2


def test_a_stream_broken_until_the_retries_run_out_is_interrupted(server, gateway, no_mesh):
    deltas = []
    with (
        Client(server.address, API_KEY, retries=1, backoff_s=0.01, mesh_file=no_mesh) as client,
        pytest.raises(StreamInterrupted, match="after 2 tokens"),
    ):
        for delta in client.stream("break"):
            deltas.append(delta.text)
    assert deltas == ["Hello", ", "]  # nothing twice
    assert len(gateway.calls("Generate")) == 2


def failover_client(server, server_b, no_mesh) -> Client:
    return Client([server.address, server_b.address], API_KEY, retries=3, backoff_s=0.01, mesh_file=no_mesh)


def test_a_broken_stream_continues_on_the_next_gateway(server, server_b, gateway, gateway_b, no_mesh):
    gateway.break_streams = True
    with failover_client(server, server_b, no_mesh) as client:
        deltas = list(client.stream("Hi", temperature=0.5))
        check_deltas(deltas)
        (first,), (second,) = gateway.calls("Generate"), gateway_b.calls("Generate")
        assert first.metadata["x-request-id"] == second.metadata["x-request-id"]
        assert second.request.continuation == gateway_pb2.Continuation(token_ids=[10], text="Hello")
        second.request.ClearField("continuation")
        assert first.request == second.request
        assert client.failovers == 1
        # The client stays on the live gateway.
        check_completion(client.generate("Hi"))
        assert client.failovers == 1
    assert len(gateway.calls("Generate")) == 1 and len(gateway_b.calls("Generate")) == 2


def test_unary_calls_fail_over_and_writes_do_not(server, server_b, gateway, gateway_b, no_mesh, tmp_path):
    gateway.unavailable_first = 100
    with failover_client(server, server_b, no_mesh) as client:
        assert client.models()[0].is_base
        assert [a.name for a in client.adapters.list()] == ["a0", "a1", "a2", "a3", "a4"]
        assert len(gateway.calls("ListModels")) == 1 and len(gateway.calls("ListAdapters")) == 0
    write_adapter(tmp_path / "lora")
    gateway.unavailable_first = 100
    with failover_client(server, server_b, no_mesh) as client, pytest.raises(Unavailable):
        client.adapters.upload(tmp_path / "lora", "mine")
    assert len(gateway_b.calls("UploadAdapter")) == 0


def test_the_backoff_doubles_up_to_its_cap():
    policy = CallPolicy("key", timeout=None, retries=10, backoff_s=0.1, max_backoff_s=1.0)
    call = policy.start(None)
    failure = Unavailable("down")
    delays = [call.retry_delay(attempt, failure) for attempt in range(11)]
    assert all(0.05 * 2**i <= delays[i] <= 0.1 * 2**i for i in range(4))
    assert all(0.5 <= d <= 1.0 for d in delays[4:10]) and delays[10] is None


def test_resource_exhausted_waits_the_servers_delay_within_the_retries_and_the_deadline():
    policy = CallPolicy(
        "key", timeout=10.0, retries=2, backoff_s=0.1, max_backoff_s=1.0, max_retry_after_s=5.0
    )
    call = policy.start(None)
    delays = [
        call.retry_delay(attempt, ResourceExhausted("quota", retry_after_s=2.0)) for attempt in range(3)
    ]
    assert all(2.0 <= d <= 2.2 for d in delays[:2]) and delays[2] is None  # never early; the retries
    assert call.retry_delay(0, ResourceExhausted("too large")) is None  # no delay: not retried
    over_the_cap, past_the_deadline = (
        ResourceExhausted("later", retry_after_s=6.0),
        ResourceExhausted("q", retry_after_s=2.0),
    )
    assert call.retry_delay(0, over_the_cap) is None  # over max_retry_after_s
    assert policy.start(1.0).retry_delay(0, past_the_deadline) is None


def test_resource_exhausted_is_retried_on_the_same_gateway_after_its_delay(server, gateway, no_mesh):
    waits: list[float] = []
    notices: list[RetryNotice] = []
    with Client(
        server.address, API_KEY, retries=2, mesh_file=no_mesh, sleep=waits.append, on_retry=notices.append
    ) as client:
        with pytest.raises(ResourceExhausted) as raised:
            client.generate("status:RESOURCE_EXHAUSTED")
        assert len(gateway.calls("Generate")) == 3 and client.failovers == 0
    assert raised.value.retry_after_s == 1.5
    assert len(waits) == 2 and all(1.5 <= w <= 1.65 for w in waits)
    assert [(n.failed_address, n.next_address, n.retry) for n in notices] == [
        (server.address, server.address, retry) for retry in (1, 2)
    ]
    with (
        Client(
            server.address, API_KEY, retries=2, mesh_file=no_mesh, sleep=waits.append, max_retry_after_s=1
        ) as c,
        pytest.raises(ResourceExhausted),
    ):
        c.generate("status:RESOURCE_EXHAUSTED")  # 1.5 s is over max_retry_after_s
    assert len(gateway.calls("Generate")) == 4 and len(waits) == 2


async def test_async_resource_exhausted_is_retried_after_its_delay(server, gateway, no_mesh):
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async with AsyncClient(server.address, API_KEY, retries=1, mesh_file=no_mesh, sleep=sleep) as client:
        with pytest.raises(ResourceExhausted):
            await client.generate("status:RESOURCE_EXHAUSTED")
    assert len(gateway.calls("Generate")) == 2 and len(waits) == 1 and 1.5 <= waits[0] <= 1.65


def test_upload_and_delete_are_not_retried(client, gateway, tmp_path):
    write_adapter(tmp_path / "lora")
    gateway.unavailable_first = 2
    with pytest.raises(Unavailable):
        client.adapters.upload(tmp_path / "lora", "mine")
    with pytest.raises(Unavailable):
        client.adapters.delete("a0")
    assert len(gateway.calls("UploadAdapter")) == len(gateway.calls("DeleteAdapter")) == 1


def test_timeout_is_the_deadline(client):
    with pytest.raises(DeadlineExceeded):
        client.generate("slow", timeout=0.2)


def test_adapters_upload_list_get_delete(client, gateway, tmp_path):
    files = write_adapter(tmp_path / "lora")
    check_upload(gateway, files, client.adapters.upload(tmp_path / "lora", "mine", public=True))
    assert [a.name for a in client.adapters.list(page_size=2)] == ["a0", "a1", "a2", "a3", "a4"]
    assert [c.request.page_token for c in gateway.calls("ListAdapters")] == ["", "2", "4"]
    page = client.adapters.list_page(page_size=3)
    assert ([a.name for a in page.adapters], page.next_page_token, page.total) == (["a0", "a1", "a2"], "3", 5)
    last = client.adapters.list_page(page_size=3, page_token=page.next_page_token)
    assert ([a.name for a in last.adapters], last.next_page_token) == (["a3", "a4"], "")
    assert client.adapters.get("a3").id == "id-3"
    with pytest.raises(NotFound):
        client.adapters.get("nope")
    assert client.adapters.delete("a0").name == "a0"
    assert gateway.calls("DeleteAdapter")[0].request.adapter == "a0"
    with pytest.raises(FileNotFoundError):
        client.adapters.upload(tmp_path / "missing", "x")


def test_upload_sends_the_tokenizer_files_that_carry_a_chat_template(client, gateway, tmp_path):
    files = write_adapter(tmp_path / "lora")
    tokenizer_files = {
        "tokenizer_config.json": json.dumps({"chat_template": "{{ messages[0].content }}"}).encode(),
        "chat_template.jinja": b"{{ messages[-1].content }}",
    }
    for name, data in tokenizer_files.items():
        (tmp_path / "lora" / name).write_bytes(data)
    (tmp_path / "lora" / "README.md").write_text("not needed to serve: not sent")
    client.adapters.upload(tmp_path / "lora", "mine")
    (upload,) = gateway.uploads
    assert upload.files == files | tokenizer_files


def test_models(client):
    base, shared = client.models()
    assert base.is_base and base.id == "" and base.base_model == "smollm2"
    assert (shared.id, shared.owner, shared.rank, shared.public) == ("bob/pub", "bob", 16, True)


def test_mesh_file_gives_the_address_and_admin_key(server, gateway, tmp_path):
    mesh = tmp_path / "mesh.json"
    mesh.write_text(
        json.dumps({"services": {"gateway": {"address": server.address}}, "admin_api_key": API_KEY})
    )
    with Client(mesh_file=mesh) as client:
        assert client.address == server.address
        assert client.generate("Hi").text == "Hello, world"
    with pytest.raises(ValueError, match="no API key"):
        Client("elsewhere:1", mesh_file=mesh)  # the admin key only goes to the mesh's gateway
    with pytest.raises(ValueError, match="no gateway address"):
        Client(mesh_file=tmp_path / "absent.json")


def test_mesh_file_lists_every_gateway(server, server_b, gateway, gateway_b, tmp_path):
    mesh = tmp_path / "mesh.json"
    mesh.write_text(
        json.dumps(
            {
                "services": {"gateway": {"address": server.address}},
                "gateway_addresses": [server.address, server_b.address],
                "admin_api_key": API_KEY,
            }
        )
    )
    gateway.unavailable_first = 100
    with Client(mesh_file=mesh) as client:
        assert client.addresses == (server.address, server_b.address)
        assert client.generate("Hi").text == "Hello, world"
    with Client(f"{server_b.address},{server.address}", mesh_file=mesh) as client:
        assert client.addresses == (server_b.address, server.address)
    with pytest.raises(ValueError, match="no API key"):
        Client([server.address, "elsewhere:1"], mesh_file=mesh)


def test_mesh_file_tls_goes_only_to_the_mesh_gateways_and_its_certificate_never(tmp_path):
    """The SDK takes the mesh file's CA alone: its certificate is the operator's, for the CLI."""
    mesh = tmp_path / "mesh.json"
    files = {"ca_file": "ca.pem", "cert_file": "operator.pem", "key_file": "operator-key.pem"}
    mesh.write_text(
        json.dumps({"gateway_addresses": ["127.0.0.1:1"], "admin_api_key": API_KEY, "tls": files})
    )
    assert resolve_targets(None, None, mesh)[2] == ClientTLS("ca.pem")
    assert resolve_targets("elsewhere:1", "key", mesh)[2] is None
    mine = ClientTLS("mine-ca.pem", "me.pem", "me-key.pem")
    assert resolve_targets(None, None, mesh, mine)[2] is mine


def test_client_tls_takes_the_ca_alone_or_with_a_whole_certificate():
    assert (ClientTLS("ca.pem").cert_file, ClientTLS("ca.pem").key_file) == ("", "")
    with pytest.raises(ValueError, match="cert_file and key_file together"):
        ClientTLS("ca.pem", "me.pem")
    with pytest.raises(ValueError, match="needs ca_file"):
        ClientTLS("")


def write_mesh_file(state_dir: Path, address: str) -> None:
    """What `loramesh up` writes, as far as a client reads it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "mesh.json").write_text(
        json.dumps({"gateway_addresses": [address], "admin_api_key": API_KEY})
    )


def test_the_state_dir_variable_names_the_mesh_file(server, gateway, tmp_path, monkeypatch):
    """Set after `import loramesh`, as a user's shell or a test would: read by each Client()."""
    monkeypatch.chdir(tmp_path)  # no .loramesh here
    write_mesh_file(tmp_path / "mesh2", server.address)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "mesh2"))
    with Client() as client:
        assert client.generate("Hi").text == "Hello, world"
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "empty"))
    with pytest.raises(NoGatewayAddress) as raised:
        Client()
    assert f"({tmp_path / 'empty' / 'mesh.json'} does not exist; $LORAMESH_STATE_DIR " in str(raised.value)
    assert raised.value.mesh_file == tmp_path / "empty" / "mesh.json"
    monkeypatch.delenv(STATE_DIR_ENV)
    with pytest.raises(ValueError, match=f"{tmp_path / '.loramesh' / 'mesh.json'} does not exist"):
        Client()


def test_on_retry_hears_of_every_retry(server, gateway, no_mesh):
    notices: list[RetryNotice] = []
    with Client(
        server.address, API_KEY, retries=3, backoff_s=0.01, mesh_file=no_mesh, on_retry=notices.append
    ) as c:
        gateway.unavailable_first = 2
        check_completion(c.generate("Hi"))
        gateway.unavailable_first = 1
        assert c.models()[0].is_base
    where = [(n.failed_address, n.next_address, n.retry, n.retries) for n in notices]
    assert where == [(server.address, server.address, retry, 3) for retry in (1, 2, 1)]
    # The backoff: 0.01 s doubling per retry, times a jitter in [0.5, 1].
    assert all(0 < n.delay_s <= 0.01 * 2 ** (n.retry - 1) for n in notices)
    assert all(isinstance(n.failure, Unavailable) for n in notices)


def test_upload_checks_the_directory_before_sending_it(client, gateway, tmp_path):
    (tmp_path / "lora").mkdir()
    with pytest.raises(
        FileNotFoundError, match=f"adapter directory {tmp_path / 'lora'} has no adapter_config.json"
    ):
        client.adapters.upload(tmp_path / "lora", "x")
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors"):
        client.adapters.upload(tmp_path / "lora", "x")
    with pytest.raises(NotADirectoryError, match="is a file, not an adapter directory"):
        client.adapters.upload(tmp_path / "lora" / "adapter_config.json", "x")
    assert gateway.calls("UploadAdapter") == []


# --- the asyncio client -------------------------------------------------------------------


async def test_async_generate_stream_chat(aclient, gateway):
    check_completion(await aclient.generate("Once upon", adapter="bob/pub", **SAMPLING))
    check_sampling_sent(gateway.calls("Generate")[0], "bob/pub")
    check_deltas([d async for d in aclient.stream("Hi")])
    check_completion(await aclient.chat([("user", "Hi")], adapter="a1", **SAMPLING))
    check_sampling_sent(gateway.calls("Chat")[0], "a1")
    check_deltas([d async for d in aclient.chat_stream([{"role": "user", "content": "Hi"}])])


@pytest.mark.parametrize("code, expected", STATUSES)
async def test_async_each_status_maps_to_its_exception(server, gateway, no_mesh, code, expected):
    async with AsyncClient(server.address, API_KEY, retries=0, mesh_file=no_mesh) as client:
        with pytest.raises(LoraMeshError) as raised:
            await client.generate(f"status:{code}")
    check_status(raised.value, code, expected, gateway)


async def test_async_retries(aclient, gateway):
    gateway.unavailable_first = 2
    check_completion(await aclient.generate("Hi"))
    assert len(gateway.calls("Generate")) == 3
    assert aclient.failovers == 2
    gateway.unavailable_first = 100
    with pytest.raises(Unavailable):
        await aclient.models()
    assert len(gateway.calls("ListModels")) == 1 + 3


async def test_async_broken_stream_is_continued_and_writes_are_not_retried(aclient, gateway, tmp_path):
    check_deltas([d async for d in aclient.stream("break", temperature=0.7)])
    continuations = [call.request.continuation for call in gateway.calls("Generate")]
    assert [list(c.token_ids) for c in continuations] == [[], [10], [10, 11]]
    write_adapter(tmp_path / "lora")
    gateway.unavailable_first = 2
    with pytest.raises(Unavailable):
        await aclient.adapters.upload(tmp_path / "lora", "mine")
    with pytest.raises(Unavailable):
        await aclient.adapters.delete("a0")
    assert len(gateway.calls("UploadAdapter")) == len(gateway.calls("DeleteAdapter")) == 1


async def test_async_failover(server, server_b, gateway, gateway_b, no_mesh):
    gateway.break_streams = True
    addresses = [server.address, server_b.address]
    async with AsyncClient(addresses, API_KEY, retries=3, backoff_s=0.01, mesh_file=no_mesh) as client:
        deltas = [d async for d in client.chat_stream([("user", "Hi")])]
        check_deltas(deltas)
        continued = gateway_b.calls("Chat")[0].request
        assert continued.continuation == gateway_pb2.Continuation(token_ids=[10], text="Hello")
        gateway_b.unavailable_first = 1  # the client is on b now; a fails too: back to a for models
        gateway.break_streams = False
        assert (await client.models())[0].is_base
    assert len(gateway.calls("Chat")) == len(gateway_b.calls("Chat")) == 1
    assert len(gateway_b.calls("ListModels")) == len(gateway.calls("ListModels")) == 1


async def test_async_client_reads_the_state_dir_variable_and_announces_retries(
    server, gateway, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    write_mesh_file(tmp_path / "mesh2", server.address)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "mesh2"))
    notices: list[RetryNotice] = []
    async with AsyncClient(retries=3, backoff_s=0.01, on_retry=notices.append) as client:
        gateway.unavailable_first = 1
        assert (await client.generate("Hi")).text == "Hello, world"
        gateway.unavailable_first = 1
        assert (await client.models())[0].is_base
    assert [(n.failed_address, n.retry) for n in notices] == [(server.address, 1)] * 2
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "empty"))
    with pytest.raises(NoGatewayAddress, match="empty"):
        AsyncClient()


async def test_async_timeout_is_the_deadline(aclient):
    with pytest.raises(DeadlineExceeded):
        await aclient.generate("slow", timeout=0.2)


async def test_async_adapters_and_models(aclient, gateway, tmp_path):
    files = write_adapter(tmp_path / "lora")
    check_upload(gateway, files, await aclient.adapters.upload(tmp_path / "lora", "mine", public=True))
    assert [a.name for a in await aclient.adapters.list(page_size=2)] == ["a0", "a1", "a2", "a3", "a4"]
    assert [c.request.page_token for c in gateway.calls("ListAdapters")] == ["", "2", "4"]
    page = await aclient.adapters.list_page(page_size=4, page_token="1")
    assert ([a.name for a in page.adapters], page.next_page_token, page.total) == (
        ["a1", "a2", "a3", "a4"],
        "",
        5,
    )
    assert (await aclient.adapters.get("a3")).id == "id-3"
    with pytest.raises(NotFound):
        await aclient.adapters.get("nope")
    assert (await aclient.adapters.delete("a0")).name == "a0"
    assert [m.id for m in await aclient.models()] == ["", "bob/pub"]
