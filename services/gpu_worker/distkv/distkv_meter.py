"""What DistKV-LLM lending costs one worker, counted where it happens (issue 13's observability).

As a debtor, its engine thread waits on creditors' ``AttendRemote`` and sends and receives the
lending RPCs' messages; as a creditor, RPC threads compute attention for other workers. A
:class:`DistKvMeter` adds these up from any thread; the heartbeat and ``/metrics`` read its
:class:`DistKvTotals`. The engine closes each step with :meth:`DistKvMeter.end_step`, which gives
the seconds that step waited on remote attention (the per-step histogram).

:class:`MeteredTransport` times a debtor's attention calls whatever carries them (gRPC, or a
creditor in the same process); :class:`MeteredLender` times the creditor's side. Bytes are
counted by the gRPC transport itself, where the serialized messages are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.attention.pool_view import PoolLayout
from services.gpu_worker.distkv.block_lender import BlockLender
from services.gpu_worker.distkv.kv_block_allocator import AttendCall
from services.gpu_worker.distkv.lend_compute_cap import LendComputeCap, LendComputeExhausted
from services.gpu_worker.distkv.remote_block_allocator import CreditorTransport, Pending
from services.gpu_worker.distkv.shared_lender import SharedLender

Clock = Callable[[], float]
Connect = Callable[[str, str], CreditorTransport]
"""(creditor id, address) -> a transport to that creditor (the engine's ``TransportFactory``)."""


@dataclass(frozen=True)
class DistKvTotals:
    """Cumulative lending traffic of one worker since it started."""

    remote_attention_s: float = 0.0
    """Seconds its steps waited on creditors' AttendRemote."""
    remote_attention_calls: int = 0
    """AttendRemote calls it made as a debtor."""
    remote_bytes_sent: int = 0
    """Serialized request bytes of the lending RPCs it called."""
    remote_bytes_received: int = 0
    """Serialized reply bytes of those RPCs."""
    lent_attention_s: float = 0.0
    """Seconds it spent computing attention over blocks it lends, for debtors."""
    lent_attention_calls: int = 0
    """Attention calls it served for debtors."""
    lent_attention_refused: int = 0
    """Attention calls it refused, over its lent-compute cap (``--lend-compute-share``)."""
    remote_attention_refused: int = 0
    """Steps whose remote attention a creditor refused over its cap (the debtor fell back)."""


class DistKvMeter:
    """Thread-safe counters of one worker's lending traffic."""

    def __init__(self, clock: Clock = time.perf_counter):
        """``clock``: seconds, monotonic (tests inject one that advances by known steps)."""
        self.clock = clock
        self.on_step_wait: Callable[[float], None] | None = None
        """Told, at the end of each step that attended over remote blocks, how long it waited."""
        self._lock = threading.Lock()
        self._totals = DistKvTotals()
        self._step_start = self._totals

    def totals(self) -> DistKvTotals:
        with self._lock:
            return self._totals

    def add_remote_attention(self, seconds: float) -> None:
        self._add(remote_attention_s=seconds, remote_attention_calls=1)

    def add_bytes(self, sent: int = 0, received: int = 0) -> None:
        self._add(remote_bytes_sent=sent, remote_bytes_received=received)

    def add_lent_attention(self, seconds: float) -> None:
        self._add(lent_attention_s=seconds, lent_attention_calls=1)

    def add_lent_refusal(self) -> None:
        self._add(lent_attention_refused=1)

    def add_remote_refusal(self) -> None:
        self._add(remote_attention_refused=1)

    def end_step(self) -> float | None:
        """Seconds the step now ending waited on remote attention; None when it made no
        AttendRemote call (a step with all its KV local)."""
        with self._lock:
            start, self._step_start = self._step_start, self._totals
        if self._step_start.remote_attention_calls == start.remote_attention_calls:
            return None
        waited = self._step_start.remote_attention_s - start.remote_attention_s
        if self.on_step_wait is not None:
            self.on_step_wait(waited)
        return waited

    def _add(self, **amounts: float) -> None:
        with self._lock:
            totals = self._totals
            self._totals = DistKvTotals(
                **{name: getattr(totals, name) + amounts.get(name, 0) for name in vars(totals)}
            )


class MeteredTransport:
    """``inner``, a creditor's lending API, with each attention call timed into ``meter``; every
    other call goes straight through."""

    def __init__(self, inner: CreditorTransport, meter: DistKvMeter):
        self.inner = inner
        self.meter = meter

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def attend(self, debtor: str, call: AttendCall[int]) -> Pending[list[PartialAttention]]:
        return _WaitMetered(self.inner.attend(debtor, call), self.meter)


class _WaitMetered:
    """A pending attention call whose caller's wait for it is timed into ``meter``: the time a
    step spent blocked on a creditor, not the time the call overlapped local work."""

    def __init__(self, pending: Pending[list[PartialAttention]], meter: DistKvMeter):
        self.pending = pending
        self.meter = meter

    def result(self) -> list[PartialAttention]:
        started = self.meter.clock()
        try:
            return self.pending.result()
        finally:
            self.meter.add_remote_attention(self.meter.clock() - started)


def metered_connect(connect: Connect, meter: DistKvMeter) -> Connect:
    """``connect`` whose transports time their attention calls into ``meter``."""
    return lambda creditor, address: MeteredTransport(connect(creditor, address), meter)


class MeteredLender(SharedLender):
    """The shared lender, timing the attention it computes for debtors into ``meter`` (the time
    inside the lender's lock: computing, not waiting for another lending call), and refusing it
    beyond ``cap`` (``LendComputeExhausted``: DistKV-LLM's compute cap)."""

    def __init__(
        self, lender: BlockLender, layout: PoolLayout, meter: DistKvMeter, cap: LendComputeCap | None = None
    ):
        """``cap``: the share of its time this worker may spend on debtors' attention (None: no cap)."""
        super().__init__(lender, layout)
        self.meter = meter
        self.cap = cap

    def attend(self, debtor: str, call: AttendCall[int]) -> list[PartialAttention]:
        with self._lock:
            cap = self.cap
            try:
                started = cap.admit() if cap is not None else 0.0
            except LendComputeExhausted:
                self.meter.add_lent_refusal()
                raise
            metered = self.meter.clock()
            try:
                partials = self.lender.attend(debtor, call)
            finally:
                if cap is not None:
                    cap.done(started)
            self.meter.add_lent_attention(self.meter.clock() - metered)
        return partials
