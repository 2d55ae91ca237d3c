"""Mutual TLS against real servers: an adapter store with mTLS on, registered in an etcd that
runs with ``--client-cert-auth``. A caller without a mesh certificate, or with one from another
CA, is refused at the handshake; a worker's certificate may pull adapters but not act for an
owner; the gateway's and the operator's may (services/runtime/security/authorization.py)."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from mesh_api.adapter_transfer import fetch_adapter, ref_by_id, ref_by_name, upload_adapter
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.runtime.errors import Unavailable
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig, list_members
from services.runtime.rpc.server import start_service
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.tls import NO_TLS, TLSConfig, aio_channel

pytestmark = pytest.mark.integration

CALL_TIMEOUT_S = 30
"""Hang guard only."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificateDirectory:
    return create_mesh_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def foreign_certs(tmp_path_factory) -> CertificateDirectory:
    """Another CA's ``gateway``: the right name, signed by the wrong authority."""
    return create_mesh_certificates(tmp_path_factory.mktemp("foreign"), ("gateway",), ca_name="another CA")


@pytest.fixture
def tls_etcd(tmp_path, certs):
    server = EtcdServer(tmp_path / "etcd", tls=certs.tls_for("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
async def tls_store(tmp_path, certs, tls_etcd):
    tls = certs.tls_for("adapter_store")
    config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"),
        grace_s=2,
        etcd_endpoints=tls_etcd.endpoint,
        tls_ca=tls.ca_file,
        tls_cert=tls.cert_file,
        tls_key=tls.key_file,
    )
    host = await start_service(AdapterStoreService(config), config)
    yield host
    await host.shutdown()


async def stats(address: str, tls: TLSConfig) -> grpc.StatusCode:
    async with aio_channel(address, tls) as channel:
        try:
            await adapter_store_pb2_grpc.AdapterStoreStub(channel).Stats(
                pb.StatsRequest(), timeout=CALL_TIMEOUT_S
            )
        except aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_call_without_a_valid_mesh_certificate_is_refused(tls_store, certs, foreign_certs):
    address = tls_store.address
    assert await stats(address, certs.tls_for("operator")) == grpc.StatusCode.OK
    assert await stats(address, certs.tls_for("admin")) == grpc.StatusCode.PERMISSION_DENIED  # etcd root
    assert await stats(address, NO_TLS) == grpc.StatusCode.UNAVAILABLE  # plaintext
    foreign = foreign_certs.tls_for("gateway")
    # Trusts the mesh CA (so it accepts the store), presents another CA's certificate.
    other_ca_client = TLSConfig(str(certs.ca_file), foreign.cert_file, foreign.key_file)
    assert await stats(address, other_ca_client) == grpc.StatusCode.UNAVAILABLE
    # TLS, but no client certificate at all.
    credentials = grpc.ssl_channel_credentials(root_certificates=certs.ca_file.read_bytes())
    async with aio.secure_channel(address, credentials) as channel:
        with pytest.raises(aio.AioRpcError) as refused:
            await adapter_store_pb2_grpc.AdapterStoreStub(channel).Stats(
                pb.StatsRequest(), timeout=CALL_TIMEOUT_S
            )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_only_the_gateway_and_operator_identities_act_for_an_owner(tls_store, certs, sample_files):
    address = tls_store.address
    async with (
        aio_channel(address, certs.tls_for("gpu_worker")) as worker_channel,
        aio_channel(address, certs.tls_for("gateway")) as gateway_channel,
        aio_channel(address, certs.tls_for("operator")) as operator_channel,
    ):
        worker = adapter_store_pb2_grpc.AdapterStoreStub(worker_channel)
        with pytest.raises(aio.AioRpcError) as denied:
            await upload_adapter(worker, sample_files, "stolen", "alice", timeout=CALL_TIMEOUT_S)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'gpu_worker' identity may not call loramesh.v1.AdapterStore/RegisterAdapter" in (
            denied.value.details()
        )

        gateway = adapter_store_pb2_grpc.AdapterStoreStub(gateway_channel)
        operator = adapter_store_pb2_grpc.AdapterStoreStub(operator_channel)
        by_gateway = await upload_adapter(gateway, sample_files, "a1", "alice", timeout=CALL_TIMEOUT_S)
        by_operator = await upload_adapter(operator, sample_files, "a2", "admin", timeout=CALL_TIMEOUT_S)
        assert (by_gateway.owner, by_operator.owner) == ("alice", "admin")

        # A worker still pulls the adapters it serves, and cannot delete them.
        info, weights = await fetch_adapter(worker, ref_by_id(by_gateway.id))
        assert info.id == by_gateway.id and weights == sample_files["adapter_model.safetensors"]
        with pytest.raises(aio.AioRpcError) as denied:
            await worker.DeleteAdapter(pb.DeleteAdapterRequest(ref=ref_by_name("alice", "a1")))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await gateway.DeleteAdapter(pb.DeleteAdapterRequest(ref=ref_by_name("alice", "a1")))


async def test_the_store_registers_in_an_etcd_with_client_cert_auth(tls_store, tls_etcd, certs):
    members = await list_members(
        MembershipConfig(etcd_endpoints=tls_etcd.endpoint, tls=certs.tls_for("operator"))
    )
    assert [(m.service, m.address) for m in members] == [("adapter_store", tls_store.address)]
    with pytest.raises(Unavailable):  # etcd refuses a client without a certificate
        await list_members(MembershipConfig(etcd_endpoints=tls_etcd.endpoint, call_timeout_s=2))
