"""A Jepsen-style history of client operations: what each client asked for, when, and what it
was told, recorded while the nemesis runs and read back by :mod:`bench.cluster.checker`.

An operation is invoked, then completed with an outcome: ``ok`` (it happened), ``fail`` (it
definitely did not happen) or ``info`` (unknown: the reply was lost, e.g. with its replica, so it
may or may not have happened). Its payload is what the checker needs to judge it without the
bytes themselves: the sha256 of an uploaded or fetched adapter, the names a listing returned, the
tokens a stream delivered with the index the client put each at.

Recording is safe from several asyncio tasks and threads at once (one lock, held only to append
or update a record). A history is written and read as JSONL, one operation per line in the order
the operations were invoked.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path


class OpKind(StrEnum):
    """What a client did."""

    UPLOAD = "upload"
    FETCH = "fetch"
    LIST = "list"
    GENERATE_STREAM = "generate-stream"
    BORROW = "borrow"
    """A generation long enough that its KV overflows its worker and is lent by creditors:
    judged as a stream, counted apart so a run shows it had some."""


class Outcome(StrEnum):
    """What the client was told."""

    OK = "ok"
    FAIL = "fail"
    INFO = "info"


class Sampling(StrEnum):
    """How a stream's tokens were chosen: what its reference can promise about them."""

    DETERMINISTIC = "deterministic"
    """Greedy on workers started with ``--deterministic``: equal to the undisturbed run, token
    for token."""
    GREEDY = "greedy"
    """Greedy with the default numerics: equal to the undisturbed run until the stream is first
    continued on another worker (which prefills what the first decoded, with other rounding)."""
    SAMPLED = "sampled"
    """Temperature > 0: no reference, only a well-formed stream."""


STREAM_KINDS = frozenset({OpKind.GENERATE_STREAM, OpKind.BORROW})


@dataclass(frozen=True)
class Op:
    """One client operation: its invocation and, once known, its completion."""

    id: int
    """Position in the history (invocation order)."""
    process: str
    """The client that ran it (one client runs one operation at a time)."""
    kind: OpKind
    key: str
    """What it was about: the adapter's name for upload/fetch, the owner for list, the prompt's
    id for streams (streams of one prompt share a reference)."""
    invoked_at: float
    """Seconds on the history's clock."""
    completed_at: float | None = None
    """None while the operation is still running (or its client vanished: read as ``info``)."""
    outcome: Outcome | None = None
    digest: str = ""
    """sha256 (hex) of the adapter weights uploaded, or of those a fetch returned."""
    error: str = ""
    """For ``fail``/``info``: the gRPC status code name first (``NOT_FOUND: ...``)."""
    names: tuple[str, ...] = ()
    """For list: every name listed (all pages)."""
    tokens: tuple[tuple[int, int], ...] = ()
    """For streams: ``(index, token id)`` in delivery order, the index being where the client put
    the token in its answer (a replayed attempt starts at the index it resumed from)."""
    finish_reason: str = ""
    """For streams: the finish reason of the last message (``stop``, ``length``...); empty when
    the stream ended without one."""
    sampling: Sampling = Sampling.DETERMINISTIC
    """For streams: what its reference promises (see :class:`Sampling`)."""
    resumed_at: tuple[int, ...] = ()
    """For streams: the token counts at which the client continued it on another worker."""
    arrived_at: tuple[float, ...] = ()
    """For streams: when each token of ``tokens`` reached the client (the history's clock), one
    per token; the tokens of one message share its time. What a fault cost the streams in
    flight is read from it (:mod:`bench.cluster.stalls`)."""

    @property
    def final_outcome(self) -> Outcome:
        """The outcome, ``info`` for an operation that never completed."""
        return self.outcome if self.outcome is not None else Outcome.INFO

    def to_json(self) -> str:
        """One JSONL line; fields left at their defaults are left out."""
        record = {k: v for k, v in asdict(self).items() if v != _DEFAULTS.get(k) or k in _ALWAYS}
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Op:
        record = json.loads(line)
        record["kind"] = OpKind(record["kind"])
        if record.get("outcome") is not None:
            record["outcome"] = Outcome(record["outcome"])
        if "sampling" in record:
            record["sampling"] = Sampling(record["sampling"])
        record["names"] = tuple(record.get("names", ()))
        record["tokens"] = tuple((int(i), int(t)) for i, t in record.get("tokens", ()))
        record["resumed_at"] = tuple(record.get("resumed_at", ()))
        record["arrived_at"] = tuple(float(t) for t in record.get("arrived_at", ()))
        return cls(**record)


_ALWAYS = frozenset({"id", "process", "kind", "key", "invoked_at"})
_DEFAULTS = {f: v for f, v in asdict(Op(0, "", OpKind.UPLOAD, "", 0.0)).items()}


@dataclass
class StreamRecord:
    """What a client has seen of one stream so far; :meth:`History.complete` takes its fields."""

    tokens: list[tuple[int, int]] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)
    arrived_at: list[float] = field(default_factory=list)
    finish_reason: str = ""

    def received(self, token_ids: Iterable[int], at: float) -> None:
        """Tokens of one message, arrived at ``at`` (the history's clock), appended after those
        received so far."""
        for token in token_ids:
            self.tokens.append((len(self.tokens), int(token)))
            self.arrived_at.append(at)

    def resumed(self) -> None:
        """The client continues the stream elsewhere from the tokens it has."""
        self.resumed_at.append(len(self.tokens))

    def payload(self) -> dict:
        return {
            "tokens": tuple(self.tokens),
            "resumed_at": tuple(self.resumed_at),
            "arrived_at": tuple(self.arrived_at),
            "finish_reason": self.finish_reason,
        }


class History:
    """Operations as they are invoked and completed; safe from asyncio tasks and threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        """Every time in the history (and in the observations checked with it) is on this clock."""
        self._ops: list[Op] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops())

    def ops(self) -> tuple[Op, ...]:
        """A snapshot, in invocation order."""
        with self._lock:
            return tuple(self._ops)

    def invoke(self, process: str, kind: OpKind, key: str, **payload) -> int:
        """Record an invocation now; returns the operation's id for :meth:`complete`.
        ``payload``: what is known at invocation (an upload's digest, a stream's sampling)."""
        now = self.clock()
        with self._lock:
            op = Op(len(self._ops), process, OpKind(kind), key, now, **payload)
            self._ops.append(op)
            return op.id

    def complete(self, op_id: int, outcome: Outcome, **payload) -> Op:
        """Record the completion of ``op_id`` now, with what it returned."""
        now = self.clock()
        with self._lock:
            op = self._ops[op_id]
            if op.outcome is not None:
                raise ValueError(f"operation {op_id} ({op.kind} {op.key}) completed twice")
            op = replace(op, completed_at=now, outcome=Outcome(outcome), **payload)
            self._ops[op_id] = op
            return op

    def write_jsonl(self, path: Path) -> None:
        path.write_text("".join(op.to_json() + "\n" for op in self.ops()))

    @classmethod
    def read_jsonl(cls, path: Path) -> tuple[Op, ...]:
        return tuple(Op.from_json(line) for line in path.read_text().splitlines() if line.strip())
