"""Mutual TLS for every server, every channel between services and every etcd client: the one
place that turns settings into gRPC credentials.

Off by default (an empty :class:`TLSConfig`): servers listen in plaintext and channels dial in
plaintext, as before. On, a server presents its certificate and requires a client certificate
signed by the mesh CA (a caller without one fails the handshake, so its call ends UNAVAILABLE),
and a channel presents its own and verifies the server's against the same CA.

The identity of a verified peer (``spiffe://loramesh/<identity>`` in its certificate, see
:mod:`services.runtime.certificates`) is what :func:`peer_identity` returns; the interceptor
binds it to :data:`peer_identity_var` for the servicers.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc as etcd_rpc
from aetcd import watcher as etcd_watcher
from grpc import aio

#: A DNS name every mesh certificate carries. In Kubernetes peers are dialled by pod IP, which no
#: certificate can name in advance; ``--tls-server-name`` set to this checks the chain and the
#: name without one.
MESH_SERVER_NAME = "mesh.loramesh"
SPIFFE_PREFIX = "spiffe://loramesh/"

ChannelOptions = Sequence[tuple[str, Any]]

peer_identity_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("peer_identity", default=None)
"""The verified mesh identity of the caller of the RPC being served; None over plaintext."""


@dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS settings of one process; all three files, or none (TLS off)."""

    ca_file: str = ""
    """PEM of the mesh CA: the only issuer whose peers (servers and clients) are trusted."""
    cert_file: str = ""
    """PEM certificate of this process's identity, presented to servers and to clients alike."""
    key_file: str = ""
    """PEM private key of ``cert_file`` (0600)."""
    server_name: str = ""
    """Name the servers' certificates are checked against instead of the dialled host (e.g.
    :data:`MESH_SERVER_NAME` where peers are dialled by IP); empty: the dialled host."""

    def __post_init__(self) -> None:
        given = [bool(self.ca_file), bool(self.cert_file), bool(self.key_file)]
        if any(given) and not all(given):
            raise ValueError("TLS needs all of the CA, certificate and key files (or none of them)")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """``(ca, cert, key)`` PEM bytes."""
        return (
            Path(self.ca_file).read_bytes(),
            Path(self.cert_file).read_bytes(),
            Path(self.key_file).read_bytes(),
        )

    def flags(self) -> list[str]:
        """The command-line flags that give a service these settings (see ``ServiceConfig``)."""
        if not self.enabled:
            return []
        flags = ["--tls-ca", self.ca_file, "--tls-cert", self.cert_file, "--tls-key", self.key_file]
        return flags + (["--tls-server-name", self.server_name] if self.server_name else [])


NO_TLS = TLSConfig()


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Present our certificate; require and verify the client's against the mesh CA."""
    ca, cert, key = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    ca, cert, key = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _options(tls: TLSConfig, options: ChannelOptions) -> list[tuple[str, Any]]:
    extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return [*options, *extra]


def add_server_port(server: aio.Server | grpc.Server, address: str, tls: TLSConfig) -> int:
    """Bind ``address`` with mutual TLS when ``tls`` is on, in plaintext otherwise; the port."""
    if tls.enabled:
        return server.add_secure_port(address, server_credentials(tls))
    return server.add_insecure_port(address)


def aio_channel(address: str, tls: TLSConfig, options: ChannelOptions = ()) -> aio.Channel:
    """An asyncio channel to another mesh member."""
    if tls.enabled:
        return aio.secure_channel(address, channel_credentials(tls), options=_options(tls, options))
    return aio.insecure_channel(address, options=list(options))


def sync_channel(address: str, tls: TLSConfig, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel to another mesh member (for code on worker threads)."""
    if tls.enabled:
        return grpc.secure_channel(address, channel_credentials(tls), options=_options(tls, options))
    return grpc.insecure_channel(address, options=list(options))


class _TLSEtcdClient(aetcd.Client):
    """aetcd 1.0 dials etcd in plaintext only; this one opens a mutual-TLS channel and builds the
    same stubs on it (aetcd's ``connect`` without its user/password step, which we never use)."""

    def __init__(self, tls: TLSConfig, **kwargs: Any):
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = aio_channel(target, self._tls, tuple(self._options.items()))
        self.kvstub = etcd_rpc.KVStub(self.channel)
        self.clusterstub = etcd_rpc.ClusterStub(self.channel)
        self.leasestub = etcd_rpc.LeaseStub(self.channel)
        self.maintenancestub = etcd_rpc.MaintenanceStub(self.channel)
        self._watcher = etcd_watcher.Watcher(
            etcd_rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()


def etcd_client(host: str, port: int, tls: TLSConfig, **kwargs: Any) -> aetcd.Client:
    """An etcd client over mutual TLS when ``tls`` is on (``kwargs`` as ``aetcd.Client``)."""
    if tls.enabled:
        return _TLSEtcdClient(tls, host=host, port=port, **kwargs)
    return aetcd.Client(host=host, port=port, **kwargs)


def peer_identity(context: aio.ServicerContext) -> str | None:
    """The mesh identity in the caller's verified certificate: its ``spiffe://loramesh/<id>`` URI
    SAN, else its CN; None when the call came over plaintext. gRPC fills the auth context only
    after verifying the chain against the CA, so what it holds can be trusted."""
    auth = context.auth_context() or {}
    for san in auth.get("x509_subject_alternative_name", ()):
        text = san.decode() if isinstance(san, bytes) else str(san)
        if text.startswith(SPIFFE_PREFIX):
            return text[len(SPIFFE_PREFIX) :]
    common_names = auth.get("x509_common_name", ())
    if common_names:
        name = common_names[0]
        return name.decode() if isinstance(name, bytes) else str(name)
    return None
