"""The SDK's channels to the gateways: TLS for a mesh that runs with it (``loramesh up --tls``),
and keepalive for a real network.

A gateway's public port is server-authenticated TLS: the client checks the gateway's certificate
against the mesh CA and presents none of its own; its API key says which tenant it is. So a
client needs the CA file alone (``ClientTLS("ca.pem")``); the local mesh's file names it, so a
client of that mesh needs no arguments. A certificate given besides is presented, and the gateway
does not read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    # A stream whose gateway vanished (no reset ever arrives) fails with UNAVAILABLE within 30 s,
    # and is continued on the next gateway, instead of waiting out the call's timeout (60 s by
    # default), which ends it for good. Gateways accept a ping every 10 s.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # What bounds the wait for a ping's answer (a minute unless set).
    ("grpc.http2.ping_timeout_ms", 10_000),
    # gRPC otherwise pings once a minute after 2 pings until the client writes, which a stream
    # never does.
    ("grpc.http2.max_pings_without_data", 0),
    # The connect deadline (gRPC's name for it; 20 s by default): a gateway that does not answer
    # is left for the next one after 5 s, and one that was down is tried again every 5 s at most.
    ("grpc.min_reconnect_backoff_ms", 5_000),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)
"""Options of every channel the SDK opens (the services' own channels use the same values)."""


@dataclass(frozen=True)
class ClientTLS:
    """The files a client trusts, and presents if any (PEM)."""

    ca_file: str
    """The mesh CA certificate: the gateway's certificate must be signed by it."""
    cert_file: str = ""
    """A client certificate of the same CA, presented to the gateway; empty (a tenant's client):
    none. The gateway's public port reads none: tenants authenticate by API key."""
    key_file: str = ""
    """The client certificate's private key (with ``cert_file`` only)."""
    server_name: str = ""
    """Name the gateway's certificate is checked against instead of the dialled host; empty: the
    host."""

    def __post_init__(self) -> None:
        if not self.ca_file:
            raise ValueError("ClientTLS needs ca_file: the mesh CA that signed the gateway's certificate")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("ClientTLS takes cert_file and key_file together, or neither (the CA alone)")

    @classmethod
    def from_mapping(cls, entry: Mapping[str, str]) -> ClientTLS:
        """From a mapping of the fields (``{"ca_file"}``, optionally ``cert_file``, ``key_file``,
        ``server_name``)."""
        return cls(
            entry["ca_file"],
            entry.get("cert_file", ""),
            entry.get("key_file", ""),
            entry.get("server_name", ""),
        )

    def credentials(self) -> grpc.ChannelCredentials:
        if not self.cert_file:
            return grpc.ssl_channel_credentials(root_certificates=Path(self.ca_file).read_bytes())
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes(),
            certificate_chain=Path(self.cert_file).read_bytes(),
        )

    def options(self) -> list[tuple[str, str | int]]:
        names = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*CHANNEL_OPTIONS, *names]


def sync_channel(address: str, tls: ClientTLS | None) -> grpc.Channel:
    """A blocking channel to ``address``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, tls.credentials(), options=tls.options())


def aio_channel(address: str, tls: ClientTLS | None) -> aio.Channel:
    """An asyncio channel to ``address``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return aio.secure_channel(address, tls.credentials(), options=tls.options())
