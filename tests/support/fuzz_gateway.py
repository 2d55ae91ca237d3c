"""A real gateway to fuzz, the settings of a fuzz run, and its bookkeeping.

:class:`FuzzGateway` runs, on one event loop in a background thread (so sync tests and
hypothesis can call it): the real gateway service (``GatewayService`` under ``start_service``:
its gRPC server with the shared interceptor, health and reflection, its OpenAI HTTP port, its
HTTP side port), a real adapter store on a temporary directory with its catalog in a real etcd
of its own, and a fake scheduler and worker.
The worker answers every request with a few tokens and cannot fail: the system under test is the
gateway's input handling, not the engine (the worker checks its own input again, with the same
functions, and is tested elsewhere).

Two tenants: ``alice``, whose key every fuzzed request may carry, and ``bob``, whose key none
does. bob has a private adapter (:attr:`FuzzGateway.secrets`: its name and store id) that no
answer to alice may contain unless her request named it, and a public one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio
from hypothesis import HealthCheck, settings

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import upload_requests
from mesh_api.v1 import (
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    types_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.rpc.server import ServiceHost, start_service

ALICE_KEY = "key-alice"
BOB_KEY = "key-bob"
ALICE_OWN = "alice-own"
BOB_PUBLIC = "bob-shared"
BOB_PRIVATE = "bob-hidden-q9z"
"""bob's private adapter: a name no random text makes, so finding it in an answer is a leak."""

START_TIMEOUT_S = 120
"""Not a timing claim: bounds starting and stopping the services, so a hang fails by name."""

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
"""What every fuzz run is under (each sets its own ``max_examples`` on top): the same examples on
every run, no example database, no deadline (no verdict on speed)."""


class SteadyWorker(worker_pb2_grpc.WorkerServicer):
    """Answers every request with up to 3 tokens (as many as ``max_tokens`` allows), each with
    the log-probabilities asked for, the last one LENGTH; it never refuses and never fails."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.requests = 0

    async def Generate(self, request: worker_pb2.GenerateRequest, context):
        self.requests += 1
        sampling = request.sampling
        count = max(1, min(sampling.max_tokens or 1, len(self.tokens)))
        for i, token in enumerate(self.tokens[:count]):
            reply = worker_pb2.GenerateResponse(token_ids=[token])
            if sampling.HasField("top_logprobs"):
                top = [token, *range(1, sampling.top_logprobs)][: sampling.top_logprobs]
                reply.logprobs.append(
                    types_pb2.TokenLogprobs(
                        logprob=-1.0, top_token_ids=top, top_logprobs=[-1.0 - j for j in range(len(top))]
                    )
                )
            if i == count - 1:
                reply.finish_reason = types_pb2.FINISH_REASON_LENGTH
            yield reply


class FixedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Places everything on the one worker."""

    def __init__(self, worker_address: str):
        self.worker_address = worker_address

    async def Place(self, request, context):
        return scheduler_pb2.PlaceResponse(worker_id="steady", address=self.worker_address)

    async def ReportCompletion(self, request, context):
        return scheduler_pb2.ReportCompletionResponse()


class FuzzGateway:
    """The services above, started; :meth:`stop` stops them."""

    def __init__(self, root: Path, adapter_files: dict[str, bytes]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-gateway", daemon=True)
        self.thread.start()
        self._servers: list[aio.Server] = []
        self._hosts: list[ServiceHost] = []
        self.etcd: EtcdServer | None = None
        """The store's etcd (its catalog), under ``root/etcd``."""
        try:
            self.etcd = EtcdServer(root / "etcd")
            self.etcd.start()
            self.run(self._start(root))
            self.secrets = self._register(adapter_files)
        except BaseException:
            self.stop()
            raise

    @classmethod
    @contextlib.contextmanager
    def with_sample_adapter(cls, root: Path, base_spec) -> Iterator[FuzzGateway]:
        """Started on ``root`` with one rank-8 sample adapter for ``base_spec`` (written under
        ``root/adapter``) as the files of each of its adapters; stopped on exit: what the fuzz
        suites run."""
        files = adapter_files(write_peft_adapter(root / "adapter", base_spec, SampleAdapterSpec(rank=8)))
        running = cls(root, files)
        try:
            yield running
        finally:
            running.stop()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(START_TIMEOUT_S)

    async def _start(self, root: Path) -> None:
        store_config = AdapterStoreConfig(
            data_dir=str(root / "store"), etcd_endpoints=self.etcd.endpoint, grace_s=1
        )
        store = await start_service(AdapterStoreService(store_config), store_config)
        self._hosts.append(store)
        self.gateway_service = GatewayService(
            GatewayConfig(
                api_keys=f"{ALICE_KEY}=alice,{BOB_KEY}=bob",
                scheduler="pending",  # set below, once the scheduler is bound
                adapter_store=store.address,
                grace_s=1,
            )
        )
        worker = SteadyWorker([])
        worker_server = aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, worker_server)
        worker_address = f"127.0.0.1:{worker_server.add_insecure_port('127.0.0.1:0')}"
        await worker_server.start()
        self._servers.append(worker_server)
        scheduler_server = aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(FixedScheduler(worker_address), scheduler_server)
        scheduler_address = f"127.0.0.1:{scheduler_server.add_insecure_port('127.0.0.1:0')}"
        await scheduler_server.start()
        self._servers.append(scheduler_server)
        self.gateway_service.config.scheduler = scheduler_address
        gateway = await start_service(self.gateway_service, self.gateway_service.config)
        self._hosts.append(gateway)
        core = self.gateway_service.core
        worker.tokens = core.encode("Fuzzing is fun.")[:3]
        self.worker = worker
        self.address = gateway.address
        """The gateway's gRPC port."""
        self.http = f"http://127.0.0.1:{self.gateway_service.openai.port}"
        """The OpenAI port."""
        self.side_http = gateway.http_address
        """The HTTP side port (``/healthz``, ``/readyz``, ``/metrics``), ``host:port``."""

    def _register(self, files: dict[str, bytes]) -> tuple[str, ...]:
        """Upload the adapters through the gateway; bob's private one's name and id."""
        secret_id = ""
        with grpc.insecure_channel(self.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for key, name, visibility in (
                (ALICE_KEY, ALICE_OWN, types_pb2.VISIBILITY_PRIVATE),
                (BOB_KEY, BOB_PUBLIC, types_pb2.VISIBILITY_PUBLIC),
                (BOB_KEY, BOB_PRIVATE, types_pb2.VISIBILITY_PRIVATE),
            ):
                reply = stub.UploadAdapter(
                    upload_requests(files, name, owner="", visibility=visibility),
                    metadata=(("authorization", f"Bearer {key}"),),
                    timeout=START_TIMEOUT_S,
                )
                if name == BOB_PRIVATE:
                    secret_id = reply.adapter.id
        return (BOB_PRIVATE, secret_id)

    def leaked(self, answer: str | bytes, asked: str | bytes) -> list[str]:
        """The secrets ``answer`` contains that ``asked`` (the request) did not."""
        answer_text = answer.decode("utf-8", "replace") if isinstance(answer, bytes) else answer
        asked_text = asked.decode("utf-8", "replace") if isinstance(asked, bytes) else asked
        return [s for s in self.secrets if s and s in answer_text and s not in asked_text]

    def stop(self) -> None:
        async def stop_all():
            for host in reversed(self._hosts):
                await host.shutdown()
            for server in self._servers:
                await server.stop(None)

        try:
            self.run(stop_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if self.etcd is not None:
                self.etcd.stop()


@dataclass
class Tally:
    """What a fuzz run tried: per target (a route or an RPC), how many inputs and which outcomes
    (HTTP statuses or gRPC status names)."""

    title: str
    outcomes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, target: str, outcome: str | int) -> None:
        self.outcomes[target][str(outcome)] += 1

    @property
    def inputs(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())

    def report(self, config) -> None:
        """Print :meth:`lines` on the terminal, past pytest's capture (``config``: pytest's)."""
        capture = config.pluginmanager.get_plugin("capturemanager")
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line("")
            for line in self.lines():
                reporter.write_line(line)

    def lines(self) -> list[str]:
        overall = Counter()
        for counts in self.outcomes.values():
            overall.update(counts)
        lines = [f"{self.title}: {self.inputs} inputs over {len(self.outcomes)} targets, 0 crashes"]
        lines.append("  all: " + _counts(overall))
        for target in sorted(self.outcomes):
            counts = self.outcomes[target]
            lines.append(f"  {target}: {sum(counts.values())} inputs; {_counts(counts)}")
        return lines


def _counts(counts: Counter) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items()))
