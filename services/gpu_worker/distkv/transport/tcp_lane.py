"""The lending lane between hosts: the same frames as the same-host lane (``lending_lane.py``: a
hello with the creditor's token first, then the lending RPCs' own messages, length-prefixed) on
one long-lived TCP connection per debtor and creditor, instead of one gRPC call per layer.

Why not gRPC: a decode step waits for one answer per layer (30 for SmolLM2-135M), and what a
round trip costs between two Python processes is almost all per-call overhead, not the wire.
Measured on loopback with messages of a decode step's size (``bench.distkv.lane_round_trip``,
docs/benchmarks.md): a unary gRPC call ~780 µs, a message on one open bidirectional gRPC stream
~440 µs, a frame on a TCP socket ~35 µs, with TLS ~35 µs too.

Security, as the gRPC lane's: the connection is opened only with a token from the creditor's
``OpenLendingLane`` RPC (mutual TLS and the authorization table guard it), which binds every
call on it to the caller's own instance. With mutual TLS on, the lane is mutual TLS too: the
creditor presents its certificate and requires one the mesh CA signed, and the debtor checks
the creditor's against the CA and the name it dials (or ``--tls-server-name``). Both sides read
the certificate files at each new connection, so a rotation applies from the next lane on, as
for gRPC's handshakes.

Failure, as the gRPC lane's: connections set the keepalives of the service channels
(``services/runtime/rpc/keepalive.py``): TCP keepalive probes after ``PING_EVERY_S`` of silence
and ``TCP_USER_TIMEOUT`` of ``PING_TIMEOUT_S``, so a creditor that vanishes (a node lost, a
partition: no reset ever comes) fails the lane within ~30 s even with nothing in flight, and a
debtor's waiting call fails with ``Unavailable`` and is recomputed; a connect gets
``CONNECT_TIMEOUT_S``, and a lane that cannot be opened leaves the debtor on gRPC.
"""

from __future__ import annotations

import socket
import ssl

from services.runtime.rpc.keepalive import CONNECT_TIMEOUT_S, PING_EVERY_S, PING_TIMEOUT_S
from services.runtime.security.tls import TLSConfig


def tune(connection: socket.socket) -> None:
    """No Nagle delay (every frame is a whole message someone waits for) and the service
    channels' keepalives."""
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, PING_EVERY_S)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, PING_TIMEOUT_S)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 1)
    # Data (or a probe) unacknowledged this long ends the connection: a creditor whose node
    # vanished mid-call is dead within PING_TIMEOUT_S, not at the call's deadline.
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, PING_TIMEOUT_S * 1000)


def listen(host: str, port: int) -> socket.socket:
    """The creditor's listening socket on ``host``:``port`` (0: any free port)."""
    return socket.create_server((host, port), family=_family(host), backlog=64)


def accepted(connection: socket.socket, tls: TLSConfig, timeout_s: float) -> socket.socket:
    """``connection`` as the creditor serves it: tuned, and with TLS on, past a mutual-TLS
    handshake (the debtor's certificate verified against the mesh CA) that must end within
    ``timeout_s``; ``ssl.SSLError`` or ``TimeoutError`` when it fails."""
    tune(connection)
    if not tls.enabled:
        return connection
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    context.load_verify_locations(cafile=tls.ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    connection.settimeout(timeout_s)
    secured = context.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
    secured.do_handshake()
    return secured


def connect(host: str, port: int, tls: TLSConfig, timeout_s: float) -> socket.socket:
    """A debtor's connection to a creditor's lane, tuned, over mutual TLS when ``tls`` is on;
    later reads and writes time out after ``timeout_s`` (a creditor that hangs is dead)."""
    connection = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    try:
        tune(connection)
        if tls.enabled:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls.cert_file, tls.key_file)
            context.load_verify_locations(cafile=tls.ca_file)
            connection = context.wrap_socket(connection, server_hostname=tls.server_name or host)
        connection.settimeout(timeout_s)
        return connection
    except BaseException:
        connection.close()
        raise


def split_host(address: str) -> str:
    """The host of a ``host:port`` address (``[v6]:port`` too): where a creditor's lane is
    dialled, beside its RPCs."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
