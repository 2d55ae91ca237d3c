"""The SDK's channels to the gateways: mutual TLS for a mesh that runs with it
(``loramesh up --tls``), and keepalive for a real network.

A mesh with mutual TLS refuses a caller without a certificate signed by its CA, so a client
presents one: the ``admin`` identity that ``loramesh certs`` makes, or any other the operator
issued. The local mesh's file names the files, so a client of that mesh needs no arguments.
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
    """The files a client presents and trusts (PEM)."""

    ca_file: str
    """The mesh CA certificate: the gateway's certificate must be signed by it."""
    cert_file: str
    """The client's certificate, signed by the same CA."""
    key_file: str
    """The client certificate's private key."""
    server_name: str = ""
    """Name the gateway's certificate is checked against instead of the dialled host; empty: the
    host."""

    @classmethod
    def from_mapping(cls, entry: Mapping[str, str]) -> ClientTLS:
        """From the ``tls`` entry of a mesh file (``{"ca_file", "cert_file", "key_file"}``)."""
        return cls(entry["ca_file"], entry["cert_file"], entry["key_file"], entry.get("server_name", ""))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes(),
            certificate_chain=Path(self.cert_file).read_bytes(),
        )

    def options(self) -> list[tuple[str, str | int]]:
        names = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*CHANNEL_OPTIONS, *names]


def sync_channel(address: str, tls: ClientTLS | None) -> grpc.Channel:
    """A blocking channel to ``address``: mutual TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, tls.credentials(), options=tls.options())


def aio_channel(address: str, tls: ClientTLS | None) -> aio.Channel:
    """An asyncio channel to ``address``: mutual TLS with ``tls``, plaintext without."""
    if tls is None:
        return aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return aio.secure_channel(address, tls.credentials(), options=tls.options())
