"""A same-host lane for the lending calls a borrowing step makes once per layer: ``AttendRemote``
(with its tail-block write) and ``WriteKv`` over a Unix socket instead of gRPC.

Why: a decode step of a borrowing request waits for one answer per layer from each creditor. A
gRPC round trip between two Python processes on loopback costs 1.3–2.5 ms on a 2-core machine,
30 of them a step; the same protobuf messages framed on a Unix socket cost ~25 µs (measured:
docs/benchmarks.md, "Borrowed KV at near-local speed"). Workers in one network namespace
of one host (``loramesh up``) take the lane; others (pods, which each have their own), or a lane
that fails to open, keep gRPC.

Who may use it: the lane is opened with the ``OpenLendingLane`` RPC, which the authorization
table and mutual TLS guard like every lending RPC. Its answer is the socket's path and a token
naming the caller's own instance, signed by the creditor and valid ``TOKEN_TTL_S``
(``lane_token.py``); a connection's first frame must be such a token, unexpired, and every call on
it acts for that debtor, whatever the message names. Before that hello nothing larger is read:
its header must say ``HELLO`` and at most ``HELLO_MAX_BYTES``, and it must arrive within
``hello_timeout_s``; anything else closes the connection after its five header bytes, with a
one-line reason logged and sent. The socket has a random name in Linux's abstract namespace
(nothing on disk, reachable from this host's network namespace only), and its traffic never
leaves the kernel.

Between hosts (``tcp_lane.py``): the same frames on a TCP connection, mutual TLS when the mesh
has it, to the port ``OpenLendingLane`` names beside the path, on the host the creditor's RPCs
are dialled at; a debtor takes it where the Unix socket cannot be reached (another network
namespace: another pod or host), or always with ``--lending-lane tcp``. No pool is offered there.

Frames, both ways: one byte (a call kind, or a status), four bytes of little-endian length, then
the serialized protobuf message (the RPCs' own request and reply messages). A refused call's
reply is ``CODE_NAME`` and the message, as the RPC's status would be.

Shared memory (``--lending-lane shared-memory``, the default): a creditor whose pool is in shared
memory answers ``POOL`` with its pool's shape (JSON) and the pool's memfd (``SCM_RIGHTS``), and
``PAGES`` (block ids as little-endian int64) with the pages of those of the debtor's blocks (int64,
one per layer each). The debtor then writes and attends over its borrowed blocks in place
(``distkv/shared_creditor_pool.py``) and sends no per-layer call at all. Only offered with mutual
TLS off: a mapped pool is readable whole, which the per-identity checks of TLS would not allow.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch
from google.protobuf.message import Message

from mesh_api.v1 import worker_pb2
from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.distkv.distkv_meter import DistKvMeter
from services.gpu_worker.distkv.shared_creditor_pool import SharedCreditorPool
from services.gpu_worker.distkv.shared_lender import SharedLender
from services.gpu_worker.distkv.transport import tcp_lane
from services.gpu_worker.distkv.transport.lane_token import (
    HELLO_MAX_BYTES,
    TOKEN_TTL_S,
    LaneTokens,
    TokenRefused,
)
from services.gpu_worker.distkv.transport.lending_proto import answer_attend_remote, apply_write_kv
from services.gpu_worker.engine.side_threads import confine_to_one_thread
from services.gpu_worker.memory.shared_memory import map_shared
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import DomainError, FailedPrecondition, Unavailable
from services.runtime.security.tls import NO_TLS, TLSConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

HELLO, ATTEND, WRITE, POOL, PAGES = 0, 1, 2, 3, 4
"""Call kinds: the token that opens a connection, ``AttendRemote``, ``WriteKv``, the shared pool,
the pages of blocks."""
OK, REFUSED = 0, 1
"""Reply statuses."""
_HEADER = struct.Struct("<BI")
_REQUESTS: dict[int, type[Message]] = {
    ATTEND: worker_pb2.AttendRemoteRequest,
    WRITE: worker_pb2.WriteKvRequest,
}


def _read_exactly(connection: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """``size`` bytes; TimeoutError past ``deadline`` (``time.monotonic``) when one is given."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            connection.settimeout(remaining)
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the lane was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(connection: socket.socket) -> tuple[int, bytes]:
    kind, size = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
    return kind, _read_exactly(connection, size)


def _read_hello(connection: socket.socket, timeout_s: float) -> bytes:
    """The token of a connection's first frame, its header checked before its payload is read:
    TokenRefused when it is not a hello or is longer than any token, TimeoutError when the whole
    frame takes longer than ``timeout_s`` (a peer dripping bytes holds no thread for long)."""
    deadline = time.monotonic() + timeout_s
    kind, size = _HEADER.unpack(_read_exactly(connection, _HEADER.size, deadline))
    if kind != HELLO:
        raise TokenRefused(f"first frame is of kind {kind}, not a hello with a lane token")
    if size > HELLO_MAX_BYTES:
        raise TokenRefused(f"hello of {size} bytes is over the {HELLO_MAX_BYTES}-byte limit of a lane token")
    return _read_exactly(connection, size, deadline)


def _frame(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


class LaneServer:
    """A creditor's lane: a Unix socket (and a TCP port, for debtors on other hosts) serving
    ``lending``'s attend and write, one thread per connected debtor (each debtor's calls in
    order, as its engine thread makes them)."""

    def __init__(
        self,
        lending: SharedLender,
        device: torch.device,
        shared_pool: UnifiedPool | None = None,
        token_ttl_s: float = TOKEN_TTL_S,
        hello_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        tcp_host: str | None = None,
        tcp_port: int = 0,
        tls: TLSConfig = NO_TLS,
    ):
        """``shared_pool``: the pool debtors may map (its buffer in shared memory), or None.
        ``token_ttl_s``: how long a token :meth:`issue` hands out opens connections (on
        ``clock``, monotonic seconds); ``hello_timeout_s``: how long a connection may take to
        present it (and, over TLS, to end its handshake). ``tcp_host``: where the lane between
        hosts listens, on ``tcp_port`` (0: any free one; None: no such lane); ``tls``: the
        worker's mutual TLS, which that lane requires when it is on."""
        self.lending = lending
        self.device = device
        self.shared_pool = (
            shared_pool if shared_pool is not None and shared_pool.shared_fd is not None else None
        )
        # In Linux's abstract namespace (a leading NUL): no file to leave behind when a worker is
        # killed; reachable from this host's network namespace only, and useless without a token.
        self.path = f"\0loramesh-lane-{secrets.token_hex(8)}"
        self._tokens = LaneTokens(token_ttl_s, clock)
        self._hello_timeout_s = hello_timeout_s
        self._tls = tls
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen()
        self._listeners = [self._listener]
        self.tcp_port = 0
        """The lane between hosts' port (0: none)."""
        if tcp_host is not None:
            self._listeners.append(tcp_lane.listen(tcp_host, tcp_port))
            self.tcp_port = self._listeners[-1].getsockname()[1]
        self._closed = False
        for listener in self._listeners:
            threading.Thread(target=self._accept, args=(listener,), name="lending-lane", daemon=True).start()

    def issue(self, debtor: str) -> str:
        """A token for ``debtor`` (the caller's verified instance): the connections it opens until
        it expires act for it."""
        return self._tokens.issue(debtor)

    def close(self) -> None:
        self._closed = True
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self.serve,
                args=(connection, listener.family != socket.AF_UNIX),
                name="lending-lane-debtor",
                daemon=True,
            ).start()

    def serve(self, connection: socket.socket, remote: bool = False) -> None:
        """Serve one connected debtor until it goes away (each on a thread of its own), once its
        hello has shown a token of ours; closes ``connection``. ``remote``: it came to the TCP
        lane (TLS first when on; no pool offered)."""
        confine_to_one_thread()
        try:
            if remote:
                connection = tcp_lane.accepted(connection, self._tls, self._hello_timeout_s)
        except (OSError, ssl.SSLError) as failed:  # a TimeoutError is an OSError
            log.warning("lending lane refused a connection: TLS handshake failed: %s", failed)
            connection.close()
            return
        pool = None if remote else self.shared_pool
        with connection:
            try:
                debtor = self._authenticate(connection)
                if debtor is None:
                    return
                while True:
                    kind, payload = _read_frame(connection)
                    if kind == POOL and pool is not None:
                        socket.send_fds(connection, [_frame(OK, self._pool_shape())], [pool.shared_fd])
                    else:
                        connection.sendall(self._answer(debtor, kind, payload))
            except (ConnectionError, OSError):
                return  # the debtor went away: its blocks are reclaimed when its lease ends

    def _authenticate(self, connection: socket.socket) -> str | None:
        """The debtor ``connection``'s hello names, answered OK; None once refused (answered
        and logged: the caller closes it)."""
        try:
            debtor = self._tokens.debtor(_read_hello(connection, self._hello_timeout_s))
        except TokenRefused as refused:
            log.warning("lending lane refused a connection: %s", refused)
            connection.sendall(_frame(REFUSED, f"UNAUTHENTICATED\n{refused}".encode()))
            return None
        except TimeoutError:
            log.warning("lending lane refused a connection: no hello within %g s", self._hello_timeout_s)
            return None
        connection.settimeout(None)
        connection.sendall(_frame(OK, b""))
        return debtor

    def _pool_shape(self) -> bytes:
        pool = self.shared_pool
        layout = pool.layout
        return json.dumps(
            {
                "num_pages": layout.num_pages,
                "kv_block_tokens": layout.kv_block_tokens,
                "kv_dim": layout.kv_dim,
                "num_layers": layout.num_layers,
                "dtype": str(pool.dtype).removeprefix("torch."),
            }
        ).encode()

    def _answer(self, debtor: str, kind: int, payload: bytes) -> bytes:
        try:
            if kind == POOL:
                raise FailedPrecondition("this worker's pool is not in shared memory on this lane")
            if kind == PAGES:
                block_ids = (
                    torch.frombuffer(bytearray(payload), dtype=torch.int64).tolist() if payload else []
                )
                pages = self.lending.pages_of(debtor, block_ids)
                return _frame(OK, torch.tensor(pages, dtype=torch.int64).numpy().tobytes() if pages else b"")
            request = _REQUESTS[kind].FromString(payload)
            if kind == ATTEND:
                reply = answer_attend_remote(self.lending, debtor, request, self.device)
            else:
                reply = apply_write_kv(self.lending, debtor, request, self.device)
            return _frame(OK, reply.SerializeToString())
        except DomainError as refused:
            return _frame(REFUSED, f"{refused.code_name}\n{refused.message}".encode())
        except Exception as failed:
            log.exception("lending lane call failed")
            return _frame(REFUSED, f"INTERNAL\n{failed}".encode())


class LaneClient:
    """A debtor's connection to one creditor's lane. Calls are sent at once and answered in
    order; ``result()`` of a call reads the replies up to its own."""

    def __init__(
        self,
        creditor: str,
        connection: socket.socket,
        token: str,
        meter: DistKvMeter,
        errors: Callable[[str, str], DomainError],
    ):
        """``connection``: to the creditor's lane, its timeout bounding each wait (a hung
        creditor is unreachable); it is closed if the token is refused (``ConnectionError``).
        ``errors(code name, message)``: the domain error a refusal raises (as the RPC's status
        would)."""
        self.creditor = creditor
        self.meter = meter
        self.errors = errors
        self.remote = connection.family != socket.AF_UNIX
        """Over TCP (the lane between hosts)."""
        self._socket = connection
        try:
            self._socket.sendall(_frame(HELLO, token.encode()))
            status, payload = _read_frame(self._socket)
        except BaseException:
            self._socket.close()
            raise
        if status != OK:
            self._socket.close()
            raise ConnectionError(payload.decode(errors="replace"))
        self._lock = threading.Lock()
        self._waiting: deque[_LaneCall] = deque()
        self._broken: str | None = None

    @classmethod
    def over_unix(
        cls,
        creditor: str,
        path: str,
        token: str,
        meter: DistKvMeter,
        errors: Callable[[str, str], DomainError],
        timeout_s: float,
    ) -> LaneClient:
        """The lane of the Unix socket ``path`` (this host's network namespace only)."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(timeout_s)
        try:
            connection.connect(path)
        except BaseException:
            connection.close()
            raise
        return cls(creditor, connection, token, meter, errors)

    @property
    def broken(self) -> bool:
        """A send or a read failed: nothing more goes over this connection."""
        return self._broken is not None

    def call(self, kind: int, request: Message, parse: Callable[[bytes], T]) -> _LaneCall:
        return self._send(kind, request.SerializeToString(), parse)

    def _send(self, kind: int, payload: bytes, parse: Callable[[bytes], T]) -> _LaneCall:
        data = _frame(kind, payload)
        call = _LaneCall(self, parse)
        with self._lock:
            self._check()
            try:
                self._socket.sendall(data)
            except OSError as error:
                self._break(error)
            self._waiting.append(call)
        self.meter.add_bytes(sent=len(data))
        return call

    def close(self) -> None:
        self._socket.close()

    def map_pool(self, dtype: torch.dtype) -> SharedCreditorPool | None:
        """The creditor's pool mapped here, or None where it offers none (a private pool, TLS
        on) or its dtype is not ``dtype``. Called before any other call on the lane."""
        with self._lock:
            self._socket.sendall(_frame(POOL, b""))
            header, fds, _, _ = socket.recv_fds(self._socket, _HEADER.size, 1)
            try:
                if len(header) < _HEADER.size:
                    header += _read_exactly(self._socket, _HEADER.size - len(header))
                status, size = _HEADER.unpack(header)
                payload = _read_exactly(self._socket, size)
                if status != OK or not fds:
                    log.info(
                        "creditor %s shares no pool: %s", self.creditor, payload.decode(errors="replace")
                    )
                    return None
                shape = json.loads(payload)
                if shape["dtype"] != str(dtype).removeprefix("torch."):
                    log.info(
                        "creditor %s's pool is %s, not %s: not mapped", self.creditor, shape["dtype"], dtype
                    )
                    return None
                layout = PoolLayout(
                    num_pages=shape["num_pages"],
                    kv_block_tokens=shape["kv_block_tokens"],
                    kv_dim=shape["kv_dim"],
                    num_layers=shape["num_layers"],
                )
                buffer = map_shared(fds[0], layout.num_pages * layout.page_elems, dtype)
                return SharedCreditorPool(self.creditor, PoolView(layout, dtype, buffer))
            finally:
                for fd in fds:
                    os.close(fd)

    def check_open(self) -> None:
        """Raise ``Unavailable`` if the creditor closed the lane (it died: a killed process's
        socket closes). A debtor working on a mapped pool sends nothing per layer, so this is how
        it learns of the death at its next step rather than at the lease's expiry."""
        with self._lock:
            self._check()
            readable, _, _ = select.select([self._socket], [], [], 0)
            if readable and not self._waiting:
                try:
                    closed = self._socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except OSError as error:
                    self._break(error)
                if closed:
                    self._break(ConnectionError("the creditor closed the lane"))

    def pages(self, block_ids: list[int]) -> list[tuple[int, ...]]:
        """The pages (one per layer) of our blocks ``block_ids`` in the creditor's pool."""
        if not block_ids:
            return []
        request = torch.tensor(block_ids, dtype=torch.int64).numpy().tobytes()
        flat = self._send(
            PAGES, request, lambda data: torch.frombuffer(bytearray(data), dtype=torch.int64)
        ).result()
        return [tuple(row) for row in flat.view(len(block_ids), -1).tolist()]

    def _result(self, call: _LaneCall):
        with self._lock:
            while not call.answered:
                self._check()
                try:
                    status, payload = _read_frame(self._socket)
                except OSError as error:
                    self._break(error)
                self.meter.add_bytes(received=_HEADER.size + len(payload))
                self._waiting.popleft().answer(status, payload)
        return call.value()

    def _check(self) -> None:
        if self._broken is not None:
            raise Unavailable(f"creditor {self.creditor}'s lending lane failed: {self._broken}")

    def _break(self, error: OSError) -> None:
        self._broken = str(error) or type(error).__name__
        self._check()


class _LaneCall:
    """One call on a lane, answered when its reply has been read."""

    def __init__(self, lane: LaneClient, parse: Callable[[bytes], object]):
        self.lane = lane
        self.parse = parse
        self.answered = False
        self._status = OK
        self._payload = b""

    def answer(self, status: int, payload: bytes) -> None:
        self.answered, self._status, self._payload = True, status, payload

    def result(self):
        if not self.answered:
            return self.lane._result(self)
        return self.value()

    def value(self):
        if self._status != OK:
            code, _, message = self._payload.decode(errors="replace").partition("\n")
            raise self.lane.errors(code, f"creditor {self.lane.creditor}: {message}")
        return self.parse(self._payload)
