"""gRPC keepalive and reconnect settings between the mesh's services, chosen for a real network.

Without them a stream to a peer that vanished (its node lost power, a partition: no reset ever
arrives) waits for its next byte forever; a Generate stream sends nothing upstream once asked,
so TCP itself never notices. With them:

- a caller pings every :data:`PING_EVERY_S` while it has calls open and gives the connection up
  :data:`PING_TIMEOUT_S` after an unanswered ping (gRPC also sets TCP_USER_TIMEOUT to it, so
  data left unacknowledged that long ends the connection too). A stream to a vanished worker
  fails with UNAVAILABLE within 30 s, and the gateway resumes it on another worker. Three
  settings make that so, each measured through a cut link: the keepalive time and timeout;
  ``grpc.http2.ping_timeout_ms``, which is what actually bounds the wait for a ping's answer
  (a minute unless set: a cut took 60 s to notice with a 1 s keepalive timeout); and
  ``grpc.http2.max_pings_without_data`` 0 (else, after two pings without the caller writing,
  gRPC pings once a minute: 56 s to notice);
- a server pings its callers on the same terms, so a worker notices a vanished gateway and
  frees the request's pages instead of generating for no one;
- a server accepts pings as often as every :data:`MIN_PING_INTERVAL_S`: gRPC servers otherwise
  answer a third ping within 5 minutes on a stream that sent nothing with GOAWAY
  ("too_many_pings"), which would cut a request waiting in a worker's queue;
- a connection attempt gets :data:`CONNECT_TIMEOUT_S` (TCP, TLS and the server's first SETTINGS
  frame at 50 ms of round trip, with one lost SYN resent after 1 s), and a peer that was down is
  tried again at least every :data:`MAX_RECONNECT_BACKOFF_S` (gRPC's default backoff grows to
  120 s: a worker restarted after a long outage would stay unreachable that long).
"""

from __future__ import annotations

PING_EVERY_S = 20
"""Seconds between keepalive pings on a connection with calls open (both directions)."""
PING_TIMEOUT_S = 10
"""Seconds an unanswered ping (or unacknowledged data) may wait before the connection is closed:
a ping is answered by gRPC's own threads, not Python's (a server whose event loop held the GIL
for 5 s kept its connection at 1 s pings with 0.5 s timeouts), so this is for the network."""
MIN_PING_INTERVAL_S = 10
"""Servers accept pings this often (half the callers' period, so jitter never counts a strike)."""
CONNECT_TIMEOUT_S = 5
"""Seconds one connection attempt may take."""
MAX_RECONNECT_BACKOFF_S = 5
"""Longest wait between two connection attempts to a peer that is down."""

Options = tuple[tuple[str, int], ...]


def channel_options(ping_every_s: float = PING_EVERY_S, ping_timeout_s: float = PING_TIMEOUT_S) -> Options:
    """Keepalive and reconnect options of a channel one service opens to another."""
    return (
        ("grpc.keepalive_time_ms", int(ping_every_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(ping_timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(ping_timeout_s * 1000)),
        # Without this gRPC sends 2 pings, then one a minute, until the caller writes again: a
        # server stream would go unwatched.
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's name for the connect deadline.
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_S * 1000),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_S * 1000),
    )


def server_options(
    ping_every_s: float = PING_EVERY_S,
    ping_timeout_s: float = PING_TIMEOUT_S,
    min_ping_interval_s: float = MIN_PING_INTERVAL_S,
) -> Options:
    """Keepalive options of a service's server: it pings its callers, and accepts their pings."""
    return (
        ("grpc.keepalive_time_ms", int(ping_every_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(ping_timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(ping_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", int(min_ping_interval_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
    )


CHANNEL_OPTIONS = channel_options()
"""Options of every channel one service opens to another (with the message size limits)."""
SERVER_OPTIONS = server_options()
"""Options of every service's server (with the message size limits)."""
