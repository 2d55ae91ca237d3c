"""The authorization table, as the real server bootstrap installs it (services/runtime/rpc/server.py):
every method of every service, read from the proto descriptors, refuses an identity outside its
row with PERMISSION_DENIED and serves one inside; a method missing from the table is refused to
everyone; on the gateway's public port every caller is a tenant, whatever certificate it holds,
and is refused every operator RPC in one line; with TLS off nothing is enforced. The docs print
the same table.

The decisions themselves (caller kind x RPC) are checked on :func:`authorize` alone, without gRPC.
Then one :class:`ServiceHost` with real mutual TLS (the project's own certificates) serves every
loramesh service at once through generic handlers that answer an empty reply, and another, the
gateway's public port, serves the Gateway service alone: what is checked is the interceptor in
front of them, not the services, whose own tests start them for real."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

import mesh_api.v1
from loramesh.tls import ClientTLS
from loramesh.tls import aio_channel as sdk_channel
from services.runtime.config import ServiceConfig
from services.runtime.errors import PermissionDenied
from services.runtime.rpc.server import ServiceHost
from services.runtime.security.authorization import CALLERS, TABLE, TENANT, authorize
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import KINDS, MeshIdentity
from services.runtime.security.tls import NO_TLS, TLSConfig, aio_channel

CALL_TIMEOUT_S = 30
"""Hang guard only."""
DOCS = Path(__file__).resolve().parents[3] / "docs" / "security.md"


def mesh_services() -> list[ServiceDescriptor]:
    """Every service in mesh_api/v1/*_pb2."""
    modules = [
        importlib.import_module(f"mesh_api.v1.{info.name}")
        for info in pkgutil.iter_modules(mesh_api.v1.__path__)
        if info.name.endswith("_pb2")
    ]
    return [service for module in modules for service in module.DESCRIPTOR.services_by_name.values()]


BOOTSTRAP_SERVICES = [
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
]
"""What every server runs beside its own service (services/runtime/rpc/server.py)."""


HEALTH_LIST = ("grpc.health.v1.Health", "List")
"""In the proto, not in grpc's asyncio health servicer: UNIMPLEMENTED once authorized."""


def every_method() -> list[MethodDescriptor]:
    return [method for service in mesh_services() + BOOTSTRAP_SERVICES for method in service.methods]


def key(method: MethodDescriptor) -> tuple[str, str]:
    return method.containing_service.full_name, method.name


#: One identity per kind: each service as `loramesh up --tls` issues it, bound to an instance;
#: the operator's, etcd's root's and etcd's shared by their kind.
IDENTITIES = {
    kind: MeshIdentity(kind, "" if kind in ("admin", "etcd", "operator") else f"{kind}-0") for kind in KINDS
}
GATEWAY = "loramesh.v1.Gateway"


def path_of(service: str, method: str) -> str:
    return f"/{service}/{method}"


def test_every_method_of_every_service_has_a_row_and_every_row_a_method():
    methods = {key(method) for method in every_method()}
    assert len(methods) > 40  # the descriptors were found
    assert sorted(methods - set(TABLE)) == []
    assert sorted(set(TABLE) - methods) == []
    assert all(rule.callers <= set(CALLERS) and rule.why for rule in TABLE.values())


def test_a_method_missing_from_the_table_is_refused_to_everyone():
    for kind in KINDS:
        with pytest.raises(PermissionDenied, match="no row of the authorization table"):
            authorize("/loramesh.v1.Worker/Unlisted", IDENTITIES[kind])
    with pytest.raises(PermissionDenied, match="no row of the authorization table"):
        authorize("/loramesh.v1.Worker/Unlisted", None, public=True)


def refusal(path: str, identity: MeshIdentity | None, public: bool = False) -> str | None:
    """The one-line refusal of :func:`authorize`, or None when it lets the caller through."""
    try:
        authorize(path, identity, public=public)
    except PermissionDenied as denied:
        assert "\n" not in denied.message
        return denied.message
    return None


def test_each_certificate_kind_is_let_through_exactly_where_its_row_names_it():
    for (service, method), rule in TABLE.items():
        for kind, identity in IDENTITIES.items():
            refused = refusal(path_of(service, method), identity)
            assert (refused is None) == (kind in rule.callers), (service, method, kind)
            if refused is not None:
                assert refused.startswith(
                    f"the {str(identity)!r} identity may not call {service}/{method}: only "
                )


def test_on_the_public_port_every_caller_is_a_tenant_let_through_the_tenant_rows_alone():
    tenant_rows = {where for where, rule in TABLE.items() if TENANT in rule.callers}
    assert {m for s, m in tenant_rows if s == GATEWAY} == {m for s, m in TABLE if s == GATEWAY}
    assert tenant_rows - {(GATEWAY, m) for _, m in tenant_rows} == {
        ("grpc.health.v1.Health", "Check"),
        ("grpc.health.v1.Health", "Watch"),
    }
    for service, method in TABLE:
        # The port reads no certificate: whatever the caller holds, it is a tenant there.
        for identity in (None, IDENTITIES["operator"], IDENTITIES["gateway"], IDENTITIES["gpu_worker"]):
            refused = refusal(path_of(service, method), identity, public=True)
            assert (refused is None) == ((service, method) in tenant_rows), (service, method)
            if refused is not None:
                assert refused.startswith(f"{service}/{method} is not for tenants: only ")
                assert refused.endswith("the gateway's public port reads no certificate, only API keys")


def test_no_certificate_is_a_tenant_nor_the_operator_on_an_internal_port():
    """Tenants hold no certificate: on a mutual-TLS port, a certificate naming the tenant kind is
    no kind the mesh issues, and one naming no identity is refused too. Neither the tenant rows
    nor the operator's take etcd's root (``admin``), and the mesh's services get no operator RPC."""
    generate = path_of(GATEWAY, "Generate")
    assert "no kind the mesh issues" in refusal(generate, MeshIdentity(TENANT, "bob"))
    assert "names no mesh identity" in refusal(generate, None)
    operator_rows = [where for where, rule in TABLE.items() if "operator" in rule.callers]
    assert len(operator_rows) > 10
    for where in operator_rows:
        assert refusal(path_of(*where), IDENTITIES["admin"]) is not None
    assert all("admin" not in rule.callers for rule in TABLE.values())
    only_operator = [where for where, rule in TABLE.items() if rule.callers == {"operator"}]
    for where in only_operator:
        for kind in ("gateway", "scheduler", "adapter_store", "gpu_worker", "kv_manager", "etcd"):
            assert refusal(path_of(*where), IDENTITIES[kind]) is not None
    assert refusal(path_of("loramesh.v1.AdapterStore", "FetchAdapter"), IDENTITIES["operator"]) is not None


class EveryService:
    """A :class:`~services.runtime.rpc.server.Service` answering every loramesh RPC with an empty
    reply (the bootstrap adds health and reflection itself)."""

    name = "every"
    grpc_service_name = "loramesh.v1.Worker"

    def add_to_server(self, server: aio.Server) -> None:
        for service in mesh_services():
            handlers = {method.name: empty_reply_handler(method) for method in service.methods}
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service.full_name, handlers),)
            )

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def load_report(self) -> dict:
        return {}


def empty_reply_handler(method: MethodDescriptor) -> grpc.RpcMethodHandler:
    request, reply = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
    codec = {"request_deserializer": request.FromString, "response_serializer": reply.SerializeToString}

    async def unary(request_or_iterator, context):
        if method.client_streaming:
            async for _ in request_or_iterator:
                pass
        return reply()

    async def stream(request_or_iterator, context):
        yield await unary(request_or_iterator, context)

    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **codec)
    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)


def request_of(method: MethodDescriptor):
    """A request each method accepts (health: the server as a whole; reflection: a listing)."""
    if method.containing_service.full_name == "grpc.reflection.v1alpha.ServerReflection":
        return reflection_pb2.ServerReflectionRequest(list_services="")
    return GetMessageClass(method.input_type)()


async def call(channel: aio.Channel, method: MethodDescriptor) -> grpc.StatusCode:
    """The status of one call of ``method`` (a stream: of its first reply)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    reply = GetMessageClass(method.output_type)
    codec = {"request_serializer": lambda m: m.SerializeToString(), "response_deserializer": reply.FromString}
    request = request_of(method)

    def requests() -> Iterator:
        yield request

    if method.client_streaming and method.server_streaming:
        rpc = channel.stream_stream(path, **codec)(requests(), timeout=CALL_TIMEOUT_S)
    elif method.client_streaming:
        rpc = channel.stream_unary(path, **codec)(requests(), timeout=CALL_TIMEOUT_S)
    elif method.server_streaming:
        rpc = channel.unary_stream(path, **codec)(request, timeout=CALL_TIMEOUT_S)
    else:
        rpc = channel.unary_unary(path, **codec)(request, timeout=CALL_TIMEOUT_S)
    try:
        if method.server_streaming:
            await rpc.read()
            rpc.cancel()
            return grpc.StatusCode.OK
        await rpc
    except aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificateDirectory:
    return create_mesh_certificates(tmp_path_factory.mktemp("certs"), IDENTITIES.values())


class PublicGateway(EveryService):
    """The gateway's public port: the Gateway service alone, no client certificate read."""

    name = "gateway"
    grpc_service_name = GATEWAY
    public_port = True

    def add_to_server(self, server: aio.Server) -> None:
        (gateway,) = [service for service in mesh_services() if service.full_name == GATEWAY]
        handlers = {method.name: empty_reply_handler(method) for method in gateway.methods}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GATEWAY, handlers),))


async def serving(tls: TLSConfig, service: EveryService | None = None) -> ServiceHost:
    config = ServiceConfig(grace_s=0, tls_ca=tls.ca_file, tls_cert=tls.cert_file, tls_key=tls.key_file)
    host = ServiceHost(service or EveryService(), config)
    await host.listen()
    await host.become_ready()
    return host


async def test_every_method_refuses_identities_outside_its_row_and_serves_those_inside(certs):
    host = await serving(certs.tls_for(IDENTITIES["gpu_worker"]))
    try:
        codes: dict[tuple[str, str, str], grpc.StatusCode] = {}
        for kind, identity in IDENTITIES.items():
            async with aio_channel(host.address, certs.tls_for(identity)) as channel:
                for method in every_method():
                    codes[(*key(method), kind)] = await call(channel, method)
    finally:
        await host.shutdown()
    denied = grpc.StatusCode.PERMISSION_DENIED
    wrong = {
        (service, method, kind): code
        for (service, method, kind), code in codes.items()
        if (code == denied) == (kind in TABLE[service, method].callers)
    }
    assert wrong == {}
    # Served means the handler answered: OK, but for grpc's health List, which it lacks.
    answers = {code for (service, method, _), code in codes.items() if (service, method) != HEALTH_LIST}
    assert answers == {grpc.StatusCode.OK, denied}
    assert codes[(*HEALTH_LIST, "operator")] == grpc.StatusCode.UNIMPLEMENTED
    refused = sum(code == grpc.StatusCode.PERMISSION_DENIED for code in codes.values())
    assert 0 < refused < len(codes)


async def test_the_refusal_names_the_identity_the_method_and_who_may_call_it(certs):
    host = await serving(certs.tls_for(IDENTITIES["gpu_worker"]))
    try:
        async with aio_channel(host.address, certs.tls_for(IDENTITIES["scheduler"])) as channel:
            read = channel.unary_unary("/loramesh.v1.Worker/ReadBlocks")
            with pytest.raises(aio.AioRpcError) as refused:
                await read(b"", timeout=CALL_TIMEOUT_S)
    finally:
        await host.shutdown()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details().startswith(
        "the 'scheduler/scheduler-0' identity may not call loramesh.v1.Worker/ReadBlocks: only gpu_worker may"
    )


async def test_the_public_port_serves_a_tenant_without_a_certificate_and_refuses_it_the_rest(certs):
    """Server-authenticated TLS: a client holding only the CA is served the Gateway's methods and
    health, and refused every other method of every service (those of other services too, which
    this port does not serve) with PERMISSION_DENIED in one line. A mesh certificate presented
    there changes nothing: the port does not ask for it."""
    host = await serving(certs.tls_for(IDENTITIES["gateway"]), PublicGateway())
    ca_only = ClientTLS(str(certs.ca_file))
    operator = ClientTLS(
        str(certs.ca_file), *map(str, (certs.cert_file("operator"), certs.key_file("operator")))
    )
    try:
        codes: dict[str, dict[tuple[str, str], grpc.StatusCode]] = {}
        for who, tls in (("tenant", ca_only), ("operator", operator)):
            codes[who] = {}
            async with sdk_channel(host.address, tls) as channel:  # the SDK's own channel
                for method in every_method():
                    codes[who][key(method)] = await call(channel, method)
            assert codes[who] == codes["tenant"], who
        async with sdk_channel(host.address, ca_only) as channel:
            ledger = channel.unary_unary("/loramesh.v1.KVManager/Ledger")
            with pytest.raises(aio.AioRpcError) as refused:
                await ledger(b"", timeout=CALL_TIMEOUT_S)
    finally:
        await host.shutdown()
    served = {where for where, rule in TABLE.items() if TENANT in rule.callers}
    assert {where for where, code in codes["tenant"].items() if code == grpc.StatusCode.OK} == served
    assert set(codes["tenant"].values()) == {grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED}
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == (
        "loramesh.v1.KVManager/Ledger is not for tenants: only operator may call it (operator's view "
        "of the debt ledger), presenting its certificate to an internal port; the gateway's public "
        "port reads no certificate, only API keys"
    )


async def test_a_method_the_server_does_not_serve_is_unimplemented_for_a_caller_its_row_names(certs):
    host = await serving(certs.tls_for(IDENTITIES["gateway"]), InternalGateway())
    try:
        for identity, expected in (("operator", "UNIMPLEMENTED"), ("gpu_worker", "PERMISSION_DENIED")):
            async with aio_channel(host.address, certs.tls_for(IDENTITIES[identity])) as channel:
                ledger = channel.unary_unary("/loramesh.v1.KVManager/Ledger")
                with pytest.raises(aio.AioRpcError) as refused:
                    await ledger(b"", timeout=CALL_TIMEOUT_S)
            assert refused.value.code().name == expected, identity
    finally:
        await host.shutdown()


class InternalGateway(PublicGateway):
    """The Gateway service alone on a mutual-TLS port (no service runs so; the test's)."""

    public_port = False


async def test_with_tls_off_the_table_is_not_enforced():
    host = await serving(NO_TLS)
    try:
        async with aio_channel(host.address, NO_TLS) as channel:
            codes = await asyncio.gather(*(call(channel, method) for method in every_method()))
    finally:
        await host.shutdown()
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED}
    assert [m for m, code in zip(every_method(), codes) if code != grpc.StatusCode.OK] == [
        health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name["List"]
    ]


def test_the_threat_model_in_the_docs_prints_the_table():
    rows = re.findall(r"^\| `([\w.]+)/(\w+)` \| ([^|]+) \|", DOCS.read_text(), re.MULTILINE)
    printed = {
        (service, method): frozenset(re.findall(r"`(\w+)`", callers)) for service, method, callers in rows
    }
    assert printed == {where: rule.callers for where, rule in TABLE.items()}
