"""TLS on every port, certificates that rotate without a restart, expired ones refused.

With TLS on, the gRPC port, the HTTP side port (/healthz, /readyz, /metrics) and the gateway's
OpenAI port speak TLS only. Replacing the certificate files of every identity of the mesh (etcd's
included) while a stream is open: the stream goes on to its end on its connection, and new
connections present the new certificates (checked by serial number). A client whose certificate
has expired fails the handshake. No sleeps: the tests run the files' check directly
(services.runtime.security.certificate_reload.check_all) instead of waiting for one.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl

import grpc
import httpx
import pytest
from cryptography import x509
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from loramesh_cli.main import main
from loramesh_cli.mesh_commands import print_summary
from loramesh_cli.mesh_file import MeshFile, ServiceEntry
from services.gateway.config import GatewayConfig
from services.gateway.http.server import OpenAIHttpServer
from services.gateway.service import GatewayService
from services.runtime.config import ServiceConfig
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig, list_members
from services.runtime.rpc.server import ServiceHost, start_service
from services.runtime.security.certificate_reload import CertificateFiles, check_all
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import KINDS
from services.runtime.security.tls import TLSConfig, aio_channel, server_credentials, sync_channel

PROBE = "test.Probe"
HANG_GUARD_S = 30


class ProbeService:
    name = "probe"
    grpc_service_name = PROBE

    def add_to_server(self, server: aio.Server) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def load_report(self) -> dict:
        return {}


def serial(certs: CertificateDirectory, identity: str) -> int:
    return x509.load_pem_x509_certificate(certs.cert_file(identity).read_bytes()).serial_number


def rotate(certs: CertificateDirectory) -> dict[str, int]:
    """Replace every identity's certificate and key by newly issued ones (the CA is kept), run
    the check a handshake or a call would; the new serials."""
    old = {identity: serial(certs, identity) for identity in KINDS}
    create_mesh_certificates(certs.path, KINDS)
    new = {identity: serial(certs, identity) for identity in KINDS}
    assert all(old[i] != new[i] for i in KINDS)
    check_all()
    return new


def client_context(tls: TLSConfig | None, ca_file: str, alpn: str = "") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if tls is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    if alpn:
        context.set_alpn_protocols([alpn])
    return context


async def served_serial(address: str, context: ssl.SSLContext) -> int:
    """The serial of the certificate a new TLS connection to ``address`` is shown."""
    host, port = address.rsplit(":", 1)
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host, int(port), ssl=context, server_hostname=host), HANG_GUARD_S
    )
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return x509.load_der_x509_certificate(der).serial_number


async def plain_http_refused(address: str, path: str) -> bool:
    """Whether a plain HTTP request to ``address`` gets no HTTP answer (closed, reset, alert)."""
    try:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as http:
            await http.get(f"http://{address}{path}")
    except (httpx.TransportError, httpx.RemoteProtocolError):
        return True
    return False


async def assert_refused(client: TLSConfig, address: str, https_address: str | None = None) -> None:
    """A client presenting ``client``'s certificate (and trusting ``client.ca_file``) gets no TLS
    connection: its health check on the gRPC port at ``address`` is UNAVAILABLE and, with
    ``https_address``, its GET of that side port's /healthz fails in TLS (with TLS 1.3 the client
    learns it at its first read: the server's alert)."""
    async with aio_channel(address, client) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HANG_GUARD_S
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    if https_address is not None:
        async with httpx.AsyncClient(
            verify=client_context(client, client.ca_file), timeout=HANG_GUARD_S
        ) as http:
            with pytest.raises(httpx.TransportError):
                await http.get(f"https://{https_address}/healthz")


@pytest.fixture
def certs(tmp_path) -> CertificateDirectory:
    return create_mesh_certificates(tmp_path / "certs", KINDS)


def service_config(certs: CertificateDirectory, identity: str, **kwargs) -> ServiceConfig:
    tls = certs.tls_for(identity)
    return ServiceConfig(
        grace_s=1, tls_ca=tls.ca_file, tls_cert=tls.cert_file, tls_key=tls.key_file, **kwargs
    )


@pytest.mark.integration
async def test_a_stream_survives_the_rotation_of_every_certificate(tmp_path, certs):
    etcd = EtcdServer(tmp_path / "etcd", tls=certs.tls_for("etcd")).start()
    host = ServiceHost(ProbeService(), service_config(certs, "scheduler", etcd_endpoints=etcd.endpoint))
    try:
        await host.listen()
        await host.become_ready()  # registered in etcd: its lease is kept alive over TLS
        operator = certs.tls_for("operator")
        grpc_hello = client_context(operator, operator.ca_file, alpn="h2")
        https = client_context(None, operator.ca_file)
        etcd_address = etcd.endpoint.removeprefix("https://")
        assert await served_serial(host.address, grpc_hello) == serial(certs, "scheduler")

        async with aio_channel(host.address, operator) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stream = health.Watch(health_pb2.HealthCheckRequest(service=PROBE), timeout=HANG_GUARD_S)
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING

            new = rotate(certs)

            # New connections, to every port, present the new certificates: no restart.
            assert (
                await served_serial(host.address, client_context(operator, operator.ca_file, "h2"))
                == new["scheduler"]
            )
            assert await served_serial(host.http_address, https) == new["scheduler"]
            assert (
                await served_serial(etcd_address, client_context(operator, operator.ca_file)) == new["etcd"]
            )
            # A new call on the same channel goes over a new connection, with the new operator key.
            check = await health.Check(health_pb2.HealthCheckRequest(service=PROBE), timeout=HANG_GUARD_S)
            assert check.status == health_pb2.HealthCheckResponse.SERVING

            # The stream opened before the rotation goes on, to its end.
            await host.health.set(PROBE, health_pb2.HealthCheckResponse.NOT_SERVING)
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stream.cancel()

        # Membership kept its lease through the rotation; etcd serves the new operator certificate.
        members = await list_members(MembershipConfig(etcd_endpoints=etcd.endpoint, tls=operator), "probe")
        assert [m.address for m in members] == [host.address]
    finally:
        await host.shutdown()
        etcd.stop()


def copy_identity(source: CertificateDirectory, target: CertificateDirectory, identity: str) -> None:
    for path in (source.cert_file(identity), source.key_file(identity)):
        copy = target.path / path.relative_to(source.path)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(path.read_bytes())


async def test_the_ca_rotates_through_a_bundle_and_the_old_one_is_then_refused(tmp_path, certs):
    """A new CA, in three steps: trust both, re-issue every certificate from the new one, drop
    the old one. A stream opened before the first step ends normally after the last; a client
    still holding a certificate of the old CA is refused once it is dropped."""
    host = ServiceHost(ProbeService(), service_config(certs, "scheduler"))
    await host.listen()
    await host.become_ready()
    old_operator = CertificateDirectory(tmp_path / "old-operator")  # a copy of the old CA's operator
    copy_identity(certs, old_operator, "operator")
    operator = certs.tls_for("operator")
    try:
        async with aio_channel(host.address, operator) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stream = health.Watch(health_pb2.HealthCheckRequest(service=PROBE), timeout=HANG_GUARD_S)
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING

            next_ca = create_mesh_certificates(tmp_path / "next", KINDS, ca_name="next mesh CA")
            old_ca = certs.ca_file.read_bytes()
            certs.ca_file.write_bytes(old_ca + next_ca.ca_file.read_bytes())  # 1. trust both
            check_all()
            for identity in KINDS:  # 2. every certificate from the new CA
                copy_identity(next_ca, certs, identity)
            check_all()
            check = health.Check(health_pb2.HealthCheckRequest(service=PROBE), timeout=HANG_GUARD_S)
            assert (await check).status == health_pb2.HealthCheckResponse.SERVING
            certs.ca_file.write_bytes(next_ca.ca_file.read_bytes())  # 3. drop the old CA
            check_all()

            assert await served_serial(host.http_address, client_context(None, operator.ca_file)) == serial(
                next_ca, "scheduler"
            )
            check = health.Check(health_pb2.HealthCheckRequest(service=PROBE), timeout=HANG_GUARD_S)
            assert (await check).status == health_pb2.HealthCheckResponse.SERVING
            await host.health.set(PROBE, health_pb2.HealthCheckResponse.NOT_SERVING)
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stream.cancel()

        # The old CA's certificate is now refused (trusting the new CA's server, to be sure why).
        stale = TLSConfig(
            operator.ca_file, str(old_operator.cert_file("operator")), str(old_operator.key_file("operator"))
        )
        await assert_refused(stale, host.address, host.http_address)
        async with httpx.AsyncClient(
            verify=client_context(operator, operator.ca_file), timeout=HANG_GUARD_S
        ) as http:
            assert (await http.get(f"https://{host.http_address}/healthz")).status_code == 200
    finally:
        await host.shutdown()


async def test_side_port_speaks_https_only_with_tls_on(certs):
    host = ServiceHost(ProbeService(), service_config(certs, "gateway"))
    await host.listen()
    try:
        assert await plain_http_refused(host.http_address, "/healthz")
        # As Kubernetes' HTTPS probe: no client certificate (and it would not check ours).
        async with httpx.AsyncClient(verify=client_context(None, certs.tls_for("operator").ca_file)) as http:
            reply = await http.get(f"https://{host.http_address}/healthz", timeout=HANG_GUARD_S)
            assert (reply.status_code, reply.text) == (200, "ok\n")
            assert (await http.get(f"https://{host.http_address}/readyz")).status_code == 503
    finally:
        await host.shutdown()


async def test_the_gateway_serves_its_openai_and_side_ports_over_tls_only(certs):
    """The gateway as `loramesh up --tls` runs it (its own certificate): both HTTP ports are
    HTTPS only. Nothing else of the mesh is needed to answer /health."""
    tls = certs.tls_for("gateway")
    config = GatewayConfig(
        grace_s=1, tls_ca=tls.ca_file, tls_cert=tls.cert_file, tls_key=tls.key_file,
        api_keys="key-alice=alice", scheduler="127.0.0.1:9", adapter_store="127.0.0.1:9",
    )  # fmt: skip
    service = GatewayService(config)
    host = await start_service(service, config)
    try:
        openai_address = f"127.0.0.1:{service.openai.port}"
        verify = client_context(None, tls.ca_file)
        for address, path in ((openai_address, "/health"), (host.http_address, "/healthz")):
            assert await plain_http_refused(address, path), address
            async with httpx.AsyncClient(verify=verify, timeout=HANG_GUARD_S) as http:
                assert (await http.get(f"https://{address}{path}")).status_code == 200, address
            assert await served_serial(address, verify) == serial(certs, "gateway")
    finally:
        await host.shutdown()


def stream_app(release: asyncio.Event) -> Starlette:
    async def events():
        yield b"data: first\n\n"
        await release.wait()
        yield b"data: second\n\n"
        yield b"data: [DONE]\n\n"

    async def stream(request):
        return StreamingResponse(events(), media_type="text/event-stream")

    async def ping(request):
        return PlainTextResponse("pong")

    return Starlette(routes=[Route("/v1/stream", stream), Route("/ping", ping)])


async def test_openai_port_speaks_https_only_and_its_sse_stream_survives_rotation(certs):
    release = asyncio.Event()
    gateway = certs.tls_for("gateway")
    server = OpenAIHttpServer(grace_s=1, tls=gateway)
    port = await server.start(stream_app(release), "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    try:
        assert server.scheme == "https"
        assert await plain_http_refused(address, "/ping")
        verify = client_context(None, gateway.ca_file)
        assert await served_serial(address, verify) == serial(certs, "gateway")
        async with httpx.AsyncClient(verify=verify, timeout=HANG_GUARD_S) as http:
            assert (await http.get(f"https://{address}/ping")).text == "pong"  # no client cert needed
            async with http.stream("GET", f"https://{address}/v1/stream") as events:
                lines = events.aiter_lines()
                assert await anext(lines) == "data: first"

                new = rotate(certs)
                assert await served_serial(address, client_context(None, gateway.ca_file)) == new["gateway"]
                release.set()
                rest = [line async for line in lines if line]
            assert rest == ["data: second", "data: [DONE]"]
    finally:
        await server.stop()


def expired(certs: CertificateDirectory, identity: str) -> TLSConfig:
    """A certificate of the mesh CA for ``identity`` that expired an hour ago."""
    an_hour = datetime.timedelta(hours=1)
    now = datetime.datetime.now(datetime.UTC)
    create_mesh_certificates(certs.path, (identity,), validity=an_hour, not_before=now - 2 * an_hour)
    return certs.tls_for(identity)


async def test_an_expired_client_certificate_is_refused(certs):
    host = ServiceHost(ProbeService(), service_config(certs, "scheduler"))
    await host.listen()
    try:
        good = certs.tls_for("operator")
        async with aio_channel(host.address, good) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HANG_GUARD_S
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Optional on the HTTPS side port, but an expired one presented is refused there too.
        await assert_refused(expired(certs, "operator/expired"), host.address, host.http_address)
    finally:
        await host.shutdown()


async def test_a_server_with_an_expired_certificate_is_refused(certs):
    stale = expired(certs, "scheduler/expired")
    server = aio.server()
    port = server.add_secure_port("127.0.0.1:0", server_credentials(stale))
    await server.start()
    try:
        await assert_refused(certs.tls_for("operator"), f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


def peer_serial_server(tls: TLSConfig, release: asyncio.Event) -> tuple[aio.Server, int]:
    """A bare server: ``Peer`` answers the serial of the caller's certificate; ``Stream`` sends
    it, waits for ``release``, sends it again."""

    def caller_serial(context) -> bytes:
        pem = context.auth_context()["x509_pem_cert"][0]
        return str(x509.load_pem_x509_certificate(pem).serial_number).encode()

    async def peer(request: bytes, context) -> bytes:
        return caller_serial(context)

    async def stream(request: bytes, context):
        yield caller_serial(context)
        await release.wait()
        yield caller_serial(context)

    handlers = {
        "Peer": grpc.unary_unary_rpc_method_handler(peer),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }
    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Peer", handlers),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    return server, port


async def test_a_channel_presents_the_new_client_certificate_to_new_calls_only(certs):
    release = asyncio.Event()
    server, port = peer_serial_server(certs.tls_for("scheduler"), release)
    await server.start()
    try:
        before = serial(certs, "gateway")
        async with aio_channel(f"127.0.0.1:{port}", certs.tls_for("gateway")) as channel:
            stream = channel.unary_stream("/test.Peer/Stream")(b"", timeout=HANG_GUARD_S)
            assert int(await stream.read()) == before
            new = rotate(certs)
            assert (
                int(await channel.unary_unary("/test.Peer/Peer")(b"", timeout=HANG_GUARD_S)) == new["gateway"]
            )
            release.set()
            assert int(await stream.read()) == before  # still on its own connection
            assert await stream.read() == aio.EOF
    finally:
        await server.stop(None)


async def test_a_blocking_channel_follows_the_rotation_too(certs):
    server, port = peer_serial_server(certs.tls_for("gpu_worker"), asyncio.Event())
    await server.start()
    try:
        with sync_channel(f"127.0.0.1:{port}", certs.tls_for("kv_manager")) as channel:
            peer = channel.unary_unary("/test.Peer/Peer")
            first = await asyncio.to_thread(peer, b"", timeout=HANG_GUARD_S)
            assert int(first) == serial(certs, "kv_manager")
            new = rotate(certs)
            again = await asyncio.to_thread(peer.with_call, b"", timeout=HANG_GUARD_S)
            assert int(again[0]) == new["kv_manager"]
    finally:
        await server.stop(None)


def test_half_replaced_files_keep_the_certificate_in_use(certs, tmp_path):
    tls = certs.tls_for("gateway")
    files = CertificateFiles(tls.ca_file, tls.cert_file, tls.key_file)
    before = files.current
    # The new key is written before its certificate: not a whole set yet.
    other = create_mesh_certificates(tmp_path / "other-ca", ("gateway",))
    certs.key_file("gateway").write_bytes(other.key_file("gateway").read_bytes())
    assert not files.check() and files.current == before
    certs.cert_file("gateway").write_bytes(b"-----BEGIN CERTIFICATE-----\ntrunc")
    assert not files.check() and files.current == before
    certs.cert_file("gateway").write_bytes(other.cert_file("gateway").read_bytes())
    assert files.check() and files.current.generation == before.generation + 1
    assert files.current.serial == serial(other, "gateway")
    assert not files.check()  # unchanged since


def test_certs_issues_short_lived_certificates(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--identity", "gateway", "--hours", "2"]) == 0
    certs = CertificateDirectory(out)
    cert = x509.load_pem_x509_certificate(certs.cert_file("gateway").read_bytes())
    ca = x509.load_pem_x509_certificate(certs.ca_file.read_bytes())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime == datetime.timedelta(hours=2)
    assert ca.not_valid_after_utc - ca.not_valid_before_utc > datetime.timedelta(days=300)
    assert main(["certs", "--out", str(out), "--hours", "-1"]) == 1
    assert "--hours must be positive" in capsys.readouterr().err


def test_up_prints_https_addresses_for_a_tls_mesh(certs, tmp_path, capsys):
    operator = certs.tls_for("operator")
    mesh = MeshFile(
        up_pid=1, etcd_endpoint="127.0.0.1:2379", etcd_pid=0, admin_api_key="k",
        services={"gateway": ServiceEntry("127.0.0.1:1", "127.0.0.1:2", 1, "gateway.log", "127.0.0.1:3")},
        tls={"ca_file": operator.ca_file, "cert_file": operator.cert_file, "key_file": operator.key_file},
    )  # fmt: skip
    print_summary(mesh, tmp_path)
    err = capsys.readouterr().err
    assert "https 127.0.0.1:2" in err and "OpenAI API https://127.0.0.1:3/v1" in err
    assert f"--cacert {operator.ca_file}" in err


async def test_closing_a_rotated_channel_closes_the_one_it_replaced(certs):
    server, port = peer_serial_server(certs.tls_for("scheduler"), asyncio.Event())
    await server.start()
    try:
        channel = aio_channel(f"127.0.0.1:{port}", certs.tls_for("gateway"))
        stream = channel.unary_stream("/test.Peer/Stream")(b"", timeout=HANG_GUARD_S)
        await stream.read()
        rotate(certs)
        await channel.unary_unary("/test.Peer/Peer")(b"", timeout=HANG_GUARD_S)  # on a new channel
        await channel.close()
        assert stream.cancelled()  # the replaced channel, waiting for it, was closed too
    finally:
        await server.stop(None)
