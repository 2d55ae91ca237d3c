"""A same-host lane for the lending calls a borrowing step makes once per layer: ``AttendRemote``
(with its tail-block write) and ``WriteKv`` over a Unix socket instead of gRPC.

Why: a decode step of a borrowing request waits for one answer per layer from each creditor. A
gRPC round trip between two Python processes on loopback costs 1.3–2.5 ms on a 2-core machine,
30 of them a step; the same protobuf messages framed on a Unix socket cost ~25 µs (measured:
docs/benchmarks.md, "Borrowed KV at near-local speed"). Workers on one host sharing its
temporary directory (``loramesh up``) take the lane; others (pods, which do not share it), or a
lane that fails to open, keep gRPC.

Who may use it: the lane is opened with the ``OpenLendingLane`` RPC, which the authorization
table and mutual TLS guard like every lending RPC. Its answer is the socket's path and a random
128-bit token bound to the caller's own instance; a connection's first frame must be a token the
creditor issued, and every call on it acts for that debtor, whatever the message names. The
socket lives in a directory only this user can enter, and its traffic never leaves the kernel.

Frames, both ways: one byte (a call kind, or a status), four bytes of little-endian length, then
the serialized protobuf message (the RPCs' own request and reply messages). A refused call's
reply is ``CODE_NAME`` and the message, as the RPC's status would be.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from google.protobuf.message import Message

from mesh_api.v1 import worker_pb2
from services.gpu_worker.lending_proto import answer_attend_remote, apply_write_kv
from services.gpu_worker.memory.distkv_meter import DistKvMeter
from services.gpu_worker.memory.shared_lender import SharedLender
from services.runtime.errors import DomainError, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

HELLO, ATTEND, WRITE = 0, 1, 2
"""Call kinds: the token that opens a connection, ``AttendRemote``, ``WriteKv``."""
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

    def __init__(self, lending: SharedLender, device: torch.device):
        self.lending = lending
        self.device = device
        self._directory = Path(tempfile.mkdtemp(prefix="loramesh-lane-"))  # mode 0700
        self.path = str(self._directory / "lend.sock")
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
        shutil.rmtree(self._directory, ignore_errors=True)

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
                    connection.sendall(self._answer(debtor, kind, payload))
            except (ConnectionError, OSError):
                return  # the debtor went away: its blocks are reclaimed when its lease ends

    def _answer(self, debtor: str, kind: int, payload: bytes) -> bytes:
        try:
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
        data = _frame(kind, request.SerializeToString())
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
