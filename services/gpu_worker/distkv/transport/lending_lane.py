"""A same-host lane for the lending calls a borrowing step makes once per layer: ``AttendRemote``
(with its tail-block write) and ``WriteKv`` over a Unix socket instead of gRPC.

Why: a decode step of a borrowing request waits for one answer per layer from each creditor. A
gRPC round trip between two Python processes on loopback costs 1.3–2.5 ms on a 2-core machine,
30 of them a step; the same protobuf messages framed on a Unix socket cost ~25 µs (measured:
docs/benchmarks.md, "Borrowed KV at near-local speed"). Workers in one network namespace
of one host (``loramesh up``) take the lane; others (pods, which each have their own), or a lane
that fails to open, keep gRPC.

Who may use it: the lane is opened with the ``OpenLendingLane`` RPC, which the authorization
table and mutual TLS guard like every lending RPC. Its answer is the socket's path and a random
128-bit token bound to the caller's own instance; a connection's first frame must be a token the
creditor issued, and every call on it acts for that debtor, whatever the message names. The
socket has a random name in Linux's abstract namespace (nothing on disk, reachable from this
host's network namespace only), and its traffic never leaves the kernel.

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
import struct
import threading
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
from services.gpu_worker.distkv.transport.lending_proto import answer_attend_remote, apply_write_kv
from services.gpu_worker.engine.side_threads import confine_to_one_thread
from services.gpu_worker.memory.shared_memory import map_shared
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import DomainError, FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

HELLO, ATTEND, WRITE, POOL, PAGES = 0, 1, 2, 3, 4
"""Call kinds: the token that opens a connection, ``AttendRemote``, ``WriteKv``, the shared pool,
the pages of blocks."""
LANE_MODES = ("shared-memory", "socket", "off")
"""``--lending-lane``: the pool mapped (calls on the socket for the rest), every call on the
socket, or no lane (gRPC)."""
OK, REFUSED = 0, 1
"""Reply statuses."""
_HEADER = struct.Struct("<BI")
_REQUESTS: dict[int, type[Message]] = {
    ATTEND: worker_pb2.AttendRemoteRequest,
    WRITE: worker_pb2.WriteKvRequest,
}


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the lane was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(connection: socket.socket) -> tuple[int, bytes]:
    kind, size = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
    return kind, _read_exactly(connection, size)


def _frame(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


class LaneServer:
    """A creditor's lane: a Unix socket serving ``lending``'s attend and write, one thread per
    connected debtor (each debtor's calls in order, as its engine thread makes them)."""

    def __init__(self, lending: SharedLender, device: torch.device, shared_pool: UnifiedPool | None = None):
        """``shared_pool``: the pool debtors may map (its buffer in shared memory), or None."""
        self.lending = lending
        self.device = device
        self.shared_pool = shared_pool if shared_pool is not None and shared_pool.shared_fd is not None else None
        # In Linux's abstract namespace (a leading NUL): no file to leave behind when a worker is
        # killed; reachable from this host's network namespace only, and useless without a token.
        self.path = f"\0loramesh-lane-{secrets.token_hex(8)}"
        self._tokens: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen()
        self._closed = False
        threading.Thread(target=self._accept, name="lending-lane", daemon=True).start()

    def issue(self, debtor: str) -> str:
        """A token for ``debtor`` (the caller's verified instance): its connections act for it."""
        token = secrets.token_hex(16)
        with self._lock:
            self._tokens[token.encode()] = debtor
        return token

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(connection,), name="lending-lane-debtor", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        confine_to_one_thread()
        with connection:
            try:
                kind, token = _read_frame(connection)
                with self._lock:
                    debtor = self._tokens.get(token) if kind == HELLO else None
                if debtor is None:
                    connection.sendall(_frame(REFUSED, b"UNAUTHENTICATED\nunknown lane token"))
                    return
                connection.sendall(_frame(OK, b""))
                while True:
                    kind, payload = _read_frame(connection)
                    if kind == POOL and self.shared_pool is not None:
                        socket.send_fds(connection, [_frame(OK, self._pool_shape())], [self.shared_pool.shared_fd])
                    else:
                        connection.sendall(self._answer(debtor, kind, payload))
            except (ConnectionError, OSError):
                return  # the debtor went away: its blocks are reclaimed when its lease ends

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
                raise FailedPrecondition("this worker's pool is not in shared memory")
            if kind == PAGES:
                block_ids = torch.frombuffer(bytearray(payload), dtype=torch.int64).tolist() if payload else []
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
        path: str,
        token: str,
        meter: DistKvMeter,
        errors: Callable[[str, str], DomainError],
        timeout_s: float,
    ):
        """``errors(code name, message)``: the domain error a refusal raises (as the RPC's
        status would); ``timeout_s`` bounds each wait (a hung creditor is unreachable)."""
        self.creditor = creditor
        self.meter = meter
        self.errors = errors
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.settimeout(timeout_s)
        self._socket.connect(path)
        self._socket.sendall(_frame(HELLO, token.encode()))
        status, payload = _read_frame(self._socket)
        if status != OK:
            self._socket.close()
            raise ConnectionError(payload.decode(errors="replace"))
        self._lock = threading.Lock()
        self._waiting: deque[_LaneCall] = deque()
        self._broken: str | None = None

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
                    log.info("creditor %s shares no pool: %s", self.creditor, payload.decode(errors="replace"))
                    return None
                shape = json.loads(payload)
                if shape["dtype"] != str(dtype).removeprefix("torch."):
                    log.info("creditor %s's pool is %s, not %s: not mapped", self.creditor, shape["dtype"], dtype)
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
        flat = self._send(PAGES, request, lambda data: torch.frombuffer(bytearray(data), dtype=torch.int64)).result()
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
