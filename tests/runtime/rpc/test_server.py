"""The shared bootstrap: health (liveness vs readiness), reflection, the HTTP side port, and
domain errors mapped to status codes in one place, with request ids in logs and metadata."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc import aio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.polling import poll_until
from support.tcp_link import TcpLink

from services.runtime import errors
from services.runtime.config import ServiceConfig
from services.runtime.etcd.lease_fence import LeaseFence
from services.runtime.logs import install_request_id_records
from services.runtime.rpc.server import ServiceHost, check_health

PROBE = "test.Probe"


class ProbeService:
    """A service whose readiness the test controls and whose RPCs raise what they are told."""

    name = "probe"
    grpc_service_name = PROBE

    def __init__(self) -> None:
        self.may_start = asyncio.Event()
        self.stopped = False

    def add_to_server(self, server: aio.Server) -> None:
        async def fail(request: bytes, context) -> bytes:
            kind = request.decode()
            if kind == "ok":
                logging.getLogger("probe").info("handled ok")
                return b"fine"
            if kind == "bug":
                raise ValueError("a bug")
            raise getattr(errors, kind)(f"{kind} raised on purpose")

        handler = grpc.unary_unary_rpc_method_handler(fail)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PROBE, {"Fail": handler}),))

    async def start(self) -> None:
        await self.may_start.wait()

    async def stop(self) -> None:
        self.stopped = True

    def load_report(self) -> dict:
        return {}


async def http_get(address: str, path: str) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture
async def probe():
    """A listening probe service, not ready until ``service.may_start`` is set."""
    service = ProbeService()
    host = ServiceHost(service, ServiceConfig(grace_s=1))
    await host.listen()
    yield service, host
    await host.shutdown()


async def ready(probe) -> ServiceHost:
    service, host = probe
    service.may_start.set()
    await host.become_ready()
    return host


async def test_readiness_follows_the_domain_and_liveness_does_not(probe):
    service, host = probe
    assert await check_health(host.address, "") == "SERVING"
    assert await check_health(host.address, PROBE) == "NOT_SERVING"
    assert await http_get(host.http_address, "/healthz") == (200, "ok\n")
    assert (await http_get(host.http_address, "/readyz"))[0] == 503
    becoming_ready = asyncio.create_task(host.become_ready())
    await asyncio.sleep(0.2)
    assert await check_health(host.address, PROBE) == "NOT_SERVING"
    service.may_start.set()
    await becoming_ready
    assert await check_health(host.address, PROBE) == "SERVING"
    assert (await http_get(host.http_address, "/readyz"))[0] == 200
    assert (await http_get(host.http_address, "/nope"))[0] == 404


@pytest.mark.parametrize(
    "kind, code",
    [
        ("InvalidArgument", grpc.StatusCode.INVALID_ARGUMENT),
        ("NotFound", grpc.StatusCode.NOT_FOUND),
        ("AlreadyExists", grpc.StatusCode.ALREADY_EXISTS),
        ("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED),
        ("Unauthenticated", grpc.StatusCode.UNAUTHENTICATED),
        ("ResourceExhausted", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION),
        ("Unavailable", grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_domain_errors_become_their_status_code(probe, kind, code):
    running = await ready(probe)
    async with aio.insecure_channel(running.address) as channel:
        call = channel.unary_unary(f"/{PROBE}/Fail")(kind.encode(), metadata=(("x-request-id", "rid-7"),))
        with pytest.raises(grpc.RpcError) as err:
            await call
        assert err.value.code() == code
        assert err.value.details() == f"{kind} raised on purpose"
        assert ("x-request-id", "rid-7") in tuple(await call.trailing_metadata())


async def test_unexpected_error_is_internal_with_request_id_and_logged(probe, caplog):
    running = await ready(probe)
    install_request_id_records()
    caplog.set_level(logging.INFO)
    async with aio.insecure_channel(running.address) as channel:
        method = channel.unary_unary(f"/{PROBE}/Fail")
        with pytest.raises(grpc.RpcError) as err:
            await method(b"bug", metadata=(("x-request-id", "rid-bug"),))
        assert err.value.code() == grpc.StatusCode.INTERNAL and "rid-bug" in err.value.details()
        assert await method(b"ok", metadata=(("x-request-id", "rid-ok"),)) == b"fine"
    records = {r.getMessage(): r for r in caplog.records}
    assert records["handled ok"].request_id == "rid-ok"
    assert any(r.request_id == "rid-bug" and r.exc_info for r in caplog.records)
    status, body = await http_get(running.http_address, "/metrics")
    assert status == 200
    assert 'loramesh_rpc_total{code="INTERNAL",method="Fail",service="probe"} 1.0' in body
    assert 'loramesh_rpc_total{code="OK",method="Fail",service="probe"} 1.0' in body


async def test_reflection_lists_the_services(probe):
    running = await ready(probe)
    async with aio.insecure_channel(running.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request])):
            names = {s.name for s in reply.list_services_response.service}
            break
    assert {PROBE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_shutdown_reports_not_serving_and_stops_the_domain(probe):
    running = await ready(probe)
    await running.shutdown()
    assert probe[0].stopped
    assert await check_health(running.address, PROBE, timeout=0.5) == "UNREACHABLE"


class FencedProbe(ProbeService):
    """A probe that, like the gpu_worker, takes the lease fence of its registration."""

    def __init__(self) -> None:
        super().__init__()
        self.fence: LeaseFence | None = None

    def fence_by_lease(self, fence: LeaseFence) -> None:
        self.fence = fence


@pytest.mark.integration
async def test_a_fenced_service_is_not_ready_while_cut_off_from_etcd_and_an_unfenced_one_is(etcd):
    """Readiness of a service that takes the fence (the worker) follows it, on the injected clock;
    one that does not (the gateway, the scheduler) stays ready through an etcd outage."""
    now = [0.0]
    link = await TcpLink(etcd.endpoint).start()
    config = ServiceConfig(grace_s=1, etcd_endpoints=link.address, lease_ttl_s=2)
    fenced, unfenced = FencedProbe(), ProbeService()
    hosts = [ServiceHost(service, config, clock=lambda: now[0]) for service in (fenced, unfenced)]
    try:
        for host, service in zip(hosts, (fenced, unfenced), strict=True):
            service.may_start.set()
            await host.listen()
            await host.become_ready()
        host = hosts[0]
        assert fenced.fence is host.registration.fence
        assert await http_get(host.http_address, "/readyz") == (200, "ready\n")
        link.cut()

        async def registered() -> bool:
            return host.registration.registered

        await poll_until(registered, lambda yes: not yes, "a keepalive through the cut link failed")
        now[0] += host.registration.fence.fence_after_s + 0.1
        status, body = await http_get(host.http_address, "/readyz")
        assert status == 503 and body.startswith("not ready: it lost etcd")

        async def health() -> str:
            return await check_health(host.address, PROBE)

        await poll_until(health, lambda status: status == "NOT_SERVING", "readiness follows the fence")
        assert await check_health(hosts[1].address, PROBE) == "SERVING"
        assert await http_get(hosts[1].http_address, "/readyz") == (200, "ready\n")
        link.heal()
        await poll_until(health, lambda status: status == "SERVING", "ready again once registered again")
        assert await http_get(host.http_address, "/readyz") == (200, "ready\n")
    finally:
        for host in hosts:
            await host.shutdown()
        await link.close()
