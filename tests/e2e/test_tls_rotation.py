"""The mesh as `loramesh up --tls` runs it (every process a real one, etcd included): every port
speaks TLS only, and a stream survives the rotation of every certificate of the mesh.

The fast, in-process versions (the CA's rotation, expired certificates, channels following the
rotation) are in tests/runtime/security/test_certificate_rotation.py; this one checks the wiring
in the real processes: each server takes its new certificate at its next handshake, without a
restart.
"""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest
from cryptography import x509

from loramesh import AsyncClient
from services.runtime.security.certificates import create_mesh_certificates
from services.runtime.security.identity import KINDS

pytestmark = [pytest.mark.integration, pytest.mark.model]

HANG_GUARD_S = 60


async def served_serial(address: str, context: ssl.SSLContext) -> int:
    """The serial of the certificate a new TLS connection to ``address`` is shown."""
    host, port = address.rsplit(":", 1)
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host, int(port), ssl=context, server_hostname=host), HANG_GUARD_S
    )
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return x509.load_der_x509_certificate(der).serial_number


async def plain_http_refused(address: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as http:
            await http.get(f"http://{address}/")
    except httpx.TransportError:
        return True
    return False


async def test_every_port_speaks_tls_only_and_a_stream_survives_rotating_every_certificate(mesh):
    certs = mesh.certs
    operator = mesh.operator_tls
    processes = [
        (mesh.store, "adapter_store"),
        (mesh.scheduler, "scheduler"),
        (mesh.gateway, "gateway"),
        *((worker, f"gpu_worker/worker-{i}") for i, worker in enumerate(mesh.workers)),
    ]
    openai_address = f"127.0.0.1:{mesh.openai_port}"
    etcd_address = mesh.etcd.endpoint.removeprefix("https://")

    def serial(identity: str) -> int:
        return x509.load_pem_x509_certificate(certs.cert_file(identity).read_bytes()).serial_number

    def hello(alpn: str = "") -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=operator.ca_file)
        context.load_cert_chain(operator.cert_file, operator.key_file)
        if alpn:
            context.set_alpn_protocols([alpn])
        return context

    for proc, _ in processes:
        assert await plain_http_refused(proc.http_address), proc.module
    assert await plain_http_refused(openai_address)

    async with AsyncClient(mesh.gateway.address, "key-alice", tls=mesh.client_tls) as client:
        stream = aiter(client.stream("Tell me a story about the sea.", max_tokens=48, ignore_eos=True))
        first = await anext(stream)

        old = {identity: serial(identity) for identity in (*KINDS, *(i for _, i in processes))}
        create_mesh_certificates(certs.path, old)  # every certificate of the mesh, the CA kept
        new = {identity: serial(identity) for identity in old}
        assert all(new[i] != old[i] for i in old)

        # No restart: each server shows its new certificate to the next connection.
        for proc, identity in processes:
            assert await served_serial(proc.address, hello("h2")) == new[identity], proc.module
            assert await served_serial(proc.http_address, hello()) == new[identity], proc.module
        assert await served_serial(openai_address, hello()) == new["gateway"]
        assert await served_serial(etcd_address, hello()) == new["etcd"]

        # The stream opened before goes on to its end.
        rest = [delta async for delta in stream]
        tokens = [*first.token_ids, *(t for delta in rest for t in delta.token_ids)]
        last = rest[-1] if rest else first
        assert (last.finish_reason, len(tokens), last.usage.completion_tokens) == ("length", 48, 48)

        # And the mesh keeps serving, its processes now calling each other with the new ones.
        again = await client.generate("Say hi.", max_tokens=4)
        assert again.finish_reason in ("stop", "length")
