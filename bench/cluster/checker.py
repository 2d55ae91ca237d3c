"""The nemesis checker: judges a history of client operations (:mod:`bench.cluster.history`)
and what was observed of the cluster (:mod:`bench.cluster.observations`) against issue 49's
invariants, and sums it up in one line:

    ``N sent, N ok, 0 lost, 0 corrupted, ledger balanced``

or the same counts followed by what broke. The invariants (bench/HISTORY.md, "The nemesis's
history, checker and fault schedule"):

- **Uploads.** Every acknowledged upload stays listed and fetchable, byte-identical: at the end
  (``StoreObservation``) and in every listing and fetch invoked after it was acknowledged. An
  upload whose outcome is unknown (``info``) may or may not exist; one that failed must not.
- **Streams.** Every stream completes, with a finish reason, and no token lost, repeated or
  changed (delivery indices run 0, 1, 2... without gaps or repeats). Two ends are not losses,
  only counted: a stream *refused* (``fail`` with RESOURCE_EXHAUSTED: the mesh said it could not
  hold it then, e.g. no worker lent the KV blocks it needed) and a stream *timed out* (``info``
  with DEADLINE_EXCEEDED: the client gave up at its deadline, whether it would have completed is
  unknown); what either delivered is judged like a complete stream's beginning. Against its reference (the
  prompt's undisturbed run): equal under ``deterministic``; under ``greedy``, equal up to the
  first point it was continued on another worker, any well-formed continuation after;
  under ``sampled``, well-formed only.
- **Ledger.** No worker ever reports more blocks lent plus free than its pool holds (a block lent
  twice, or lent while free), lends to itself or past its cap; at the end every loan is returned
  or reclaimed: no worker holds or owes any block.
- **Leadership.** One kv_manager per term; every accepted leader write carries its writer's
  own term; once a newer term has begun, no write of an older term is accepted (a deposed
  leader is fenced).
- **Recovery.** Every service serves again within ``heal_bound_s`` of each fault's heal.

Only the operations and observations passed in are judged: what was not observed is not
claimed (the summary says ``ledger not observed`` without block reports).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bench.cluster.history import STREAM_KINDS, Op, OpKind, Outcome, Sampling
from bench.cluster.observations import (
    Heal,
    LeaderTerm,
    LeaderWrite,
    LedgerSnapshot,
    StoreObservation,
)


@dataclass
class Verdict:
    """What the checker found; each problem is one line naming the operation or observation."""

    sent: int = 0
    """Operations invoked."""
    ok: int = 0
    """Operations completed ``ok``."""
    lost: list[str] = field(default_factory=list)
    """Operations whose effect is gone: an acknowledged upload missing or unfetchable, a stream
    that never completed (one line per operation)."""
    corrupted: list[str] = field(default_factory=list)
    """Operations whose data changed: other bytes, a phantom upload, a stream with tokens lost,
    repeated or changed (one line per operation)."""
    ledger: list[str] | None = None
    """Ledger violations; None when no block reports were observed."""
    leadership: list[str] = field(default_factory=list)
    recovery: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """Streams refused with RESOURCE_EXHAUSTED (a definite ``fail``, not a loss)."""
    timed_out: list[str] = field(default_factory=list)
    """Streams the client gave up at its deadline (``info``: indeterminate, not a success)."""
    streams: int = 0
    """Streams judged (borrowed ones included)."""
    borrowed_streams: int = 0
    fenced_writes: int = 0
    """Leader writes refused as fenced (what fencing is for, not a violation)."""
    max_time_to_serving_s: float = 0.0

    @property
    def holds(self) -> bool:
        return not (self.lost or self.corrupted or self.ledger or self.leadership or self.recovery)

    def _ledger_words(self) -> str:
        if self.ledger is None:
            return "ledger not observed"
        return "ledger unbalanced" if self.ledger else "ledger balanced"

    @property
    def summary(self) -> str:
        """One line: the counts, then the first problem of each kind that broke."""
        unfinished = [f"{len(found)} {words}, " for words, found in self._unfinished() if found]
        line = (
            f"{self.sent} sent, {self.ok} ok, {''.join(unfinished)}{len(self.lost)} lost, "
            f"{len(self.corrupted)} corrupted, {self._ledger_words()}"
        )
        broke = [
            f"{name}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            for name, problems in self._problems()
            if problems
        ]
        return "; ".join([line, *broke])

    def report(self) -> str:
        """The summary, then every problem on a line of its own."""
        lines = [self.summary]
        for name, problems in [*self._unfinished(), *self._problems()]:
            lines += [f"  {name}: {p}" for p in problems]
        return "\n".join(lines)

    def _unfinished(self) -> list[tuple[str, list[str]]]:
        """The streams that ended neither complete nor lost, by how."""
        return [("refused", self.refused), ("timed out", self.timed_out)]

    def _problems(self) -> list[tuple[str, list[str]]]:
        return [
            ("lost", self.lost),
            ("corrupted", self.corrupted),
            ("ledger", self.ledger or []),
            ("leadership", self.leadership),
            ("recovery", self.recovery),
        ]


def check(
    ops: Sequence[Op],
    final_store: StoreObservation | None = None,
    references: Mapping[str, Sequence[int]] | None = None,
    ledger: Sequence[LedgerSnapshot] = (),
    leader_terms: Sequence[LeaderTerm] = (),
    leader_writes: Sequence[LeaderWrite] = (),
    heals: Sequence[Heal] = (),
    heal_bound_s: float = 30.0,
) -> Verdict:
    """Judge a run. ``references``: prompt id -> its undisturbed run's token ids (needed by the
    deterministic and greedy streams); ``heal_bound_s``: how long after a heal every service
    may take to serve again."""
    verdict = Verdict(sent=len(ops), ok=sum(op.outcome == Outcome.OK for op in ops))
    uploads = Uploads(ops)
    _check_store_ops(ops, uploads, verdict)
    if final_store is not None:
        found = final_store_findings(uploads.expected(), final_store)
        verdict.lost += found.lost
        verdict.corrupted += found.corrupted
        verdict.corrupted += [
            f"upload {name} failed but is listed at the end (a phantom)"
            for name in sorted(uploads.failed_only() & final_store.listed)
        ]
    for op in ops:
        if op.kind in STREAM_KINDS:
            verdict.streams += 1
            verdict.borrowed_streams += op.kind == OpKind.BORROW
            _judge_stream(op, references or {}, verdict)
    if ledger:
        verdict.ledger = ledger_problems(ledger)
    verdict.leadership = leadership_problems(leader_terms, leader_writes)
    verdict.fenced_writes = sum(not w.accepted for w in leader_writes)
    verdict.recovery, verdict.max_time_to_serving_s = recovery_problems(heals, heal_bound_s)
    return verdict


class Uploads:
    """The uploads of a history, by name."""

    def __init__(self, ops: Iterable[Op]):
        self.ops: dict[str, list[Op]] = defaultdict(list)
        for op in ops:
            if op.kind == OpKind.UPLOAD:
                self.ops[op.key].append(op)

    def expected(self) -> dict[str, frozenset[str]]:
        """Acknowledged names -> every digest they may hold (acknowledged or in doubt)."""
        return {
            name: frozenset(op.digest for op in ops if op.final_outcome != Outcome.FAIL)
            for name, ops in self.ops.items()
            if any(op.outcome == Outcome.OK for op in ops)
        }

    def failed_only(self) -> set[str]:
        """Names every upload of which failed: they must not exist."""
        return {name for name, ops in self.ops.items() if all(op.outcome == Outcome.FAIL for op in ops)}

    def acknowledged_before(self, name: str, moment: float) -> bool:
        return any(
            op.outcome == Outcome.OK and op.completed_at is not None and op.completed_at < moment
            for op in self.ops.get(name, ())
        )

    def possible_digests(self, name: str, until: float) -> set[str]:
        """Digests ``name`` may hold for a read completing at ``until``: those of its uploads
        invoked before then and not failed."""
        return {
            op.digest
            for op in self.ops.get(name, ())
            if op.invoked_at < until and op.final_outcome != Outcome.FAIL
        }


def _check_store_ops(ops: Sequence[Op], uploads: Uploads, verdict: Verdict) -> None:
    """Fetches and listings during the run see every upload acknowledged before they began."""
    for op in ops:
        if op.kind == OpKind.FETCH and op.key in uploads.ops:
            if op.outcome == Outcome.OK:
                end = op.completed_at if op.completed_at is not None else float("inf")
                if op.digest not in uploads.possible_digests(op.key, end):
                    verdict.corrupted.append(f"fetch #{op.id} of {op.key} returned bytes never uploaded")
            elif op.error.startswith("NOT_FOUND") and uploads.acknowledged_before(op.key, op.invoked_at):
                verdict.lost.append(f"fetch #{op.id} of acknowledged {op.key} answered {op.error}")
        elif op.kind == OpKind.LIST and op.outcome == Outcome.OK:
            listed = set(op.names)
            missing = sorted(
                name
                for name in uploads.ops
                if name.startswith(op.key) and name not in listed
                and uploads.acknowledged_before(name, op.invoked_at)
            )  # fmt: skip
            if missing:
                verdict.lost.append(f"list #{op.id} missed acknowledged {', '.join(missing)}")


@dataclass
class StoreFindings:
    """Acknowledged uploads the store lost or changed, one line each."""

    missing_from_listing: list[str] = field(default_factory=list)
    not_fetchable: list[str] = field(default_factory=list)
    wrong_bytes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> list[str]:
        return [f"upload {n} acknowledged but not listed at the end" for n in self.missing_from_listing] + [
            f"upload {n} acknowledged but not fetchable at the end" for n in self.not_fetchable
        ]

    @property
    def corrupted(self) -> list[str]:
        return [f"upload {n} fetched with other bytes at the end" for n in self.wrong_bytes]


def final_store_findings(
    expected: Mapping[str, frozenset[str]], observation: StoreObservation
) -> StoreFindings:
    """Each name of ``expected`` (name -> the digests it may hold) is listed and fetched with one
    of its digests. Shared with :mod:`bench.cluster.store_nemesis`."""
    found = StoreFindings()
    for name, digests in sorted(expected.items()):
        if name not in observation.listed:
            found.missing_from_listing.append(name)
        elif name not in observation.digests:
            found.not_fetchable.append(name)
        elif observation.digests[name] not in digests:
            found.wrong_bytes.append(name)
    return found


def _judge_stream(op: Op, references: Mapping[str, Sequence[int]], verdict: Verdict) -> None:
    what = f"{op.kind} #{op.id} ({op.key}, {op.process})"
    unfinished = _unfinished_list(op, verdict)
    if unfinished is not None:
        unfinished.append(f"{what} after {len(op.tokens)} tokens: {op.error}")
    elif op.outcome != Outcome.OK:
        verdict.lost.append(f"{what} did not complete: {op.final_outcome} {op.error}".rstrip())
        return
    elif not op.finish_reason:
        verdict.lost.append(f"{what} ended without a finish reason after {len(op.tokens)} tokens")
        return
    tokens, broken = stream_tokens(op.tokens)
    if broken:
        verdict.corrupted.append(f"{what}: {broken}")
        return
    if op.sampling == Sampling.SAMPLED:
        return
    if op.key not in references:
        raise ValueError(f"{what} is {op.sampling} but prompt {op.key!r} has no reference run")
    reference = list(references[op.key])
    if unfinished is not None:  # what it delivered is the beginning of its run
        reference = reference[: len(tokens)]
    if op.sampling == Sampling.GREEDY and op.resumed_at:
        # What the first worker decoded is the undisturbed run; the continuation may round
        # otherwise (it prefills those tokens) and take another greedy path from there.
        first = op.resumed_at[0]
        differs = first_difference(tokens[:first], reference[:first])
    else:
        differs = first_difference(tokens, reference)
    if differs is not None:
        got = tokens[differs] if differs < len(tokens) else "the end"
        want = reference[differs] if differs < len(reference) else "the end"
        verdict.corrupted.append(
            f"{what} differs from its undisturbed run at token {differs}: {got} instead of {want}"
        )


def _unfinished_list(op: Op, verdict: Verdict) -> list[str] | None:
    """Where a stream that ended neither complete nor lost is counted (None: it is not one)."""
    if op.outcome == Outcome.FAIL and op.error.startswith("RESOURCE_EXHAUSTED"):
        return verdict.refused
    if op.outcome == Outcome.INFO and op.error.startswith("DEADLINE_EXCEEDED"):
        return verdict.timed_out
    return None


def stream_tokens(deliveries: Sequence[tuple[int, int]]) -> tuple[list[int], str]:
    """The tokens of a stream from its ``(index, token)`` deliveries, and what is wrong with them
    ("" when each index came once, in order): a gap is tokens lost, an index seen before is a
    token repeated (same id) or changed (another)."""
    tokens: list[int] = []
    for index, token in deliveries:
        if index > len(tokens):
            return tokens, f"tokens {len(tokens)}..{index - 1} lost (next came token {index})"
        if index < len(tokens):
            how = "repeated" if tokens[index] == token else f"changed from {tokens[index]} to {token}"
            return tokens, f"token {index} {how}"
        tokens.append(token)
    return tokens, ""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (one ending counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ledger_problems(snapshots: Sequence[LedgerSnapshot]) -> list[str]:
    """Every snapshot is possible; the last one owes nothing."""
    problems: list[str] = []
    for snapshot in snapshots:
        for r in snapshot.reports:
            at = f"at {snapshot.at:.3f}"
            if r.worker_id in r.lent:
                problems.append(f"{r.worker_id} lends {r.lent[r.worker_id]} blocks to itself {at}")
            if r.free_blocks + r.lent_total > r.total_blocks:
                problems.append(
                    f"{r.worker_id} reports {r.lent_total} blocks lent + {r.free_blocks} free > "
                    f"{r.total_blocks} in its pool {at} (a block counted twice)"
                )
            if r.lend_cap_blocks is not None and r.lent_total > r.lend_cap_blocks:
                problems.append(
                    f"{r.worker_id} lends {r.lent_total} blocks past its cap of {r.lend_cap_blocks} {at}"
                )
    last = snapshots[-1]
    for r in last.reports:
        for debtor, blocks in sorted(r.lent.items()):
            problems.append(f"{r.worker_id} still holds {blocks} blocks for {debtor} at the end")
        for creditor, blocks in sorted(r.borrowed.items()):
            problems.append(f"{r.worker_id} still has {blocks} blocks held by {creditor} at the end")
    return problems


def leadership_problems(terms: Sequence[LeaderTerm], writes: Sequence[LeaderWrite]) -> list[str]:
    """One leader per term, writes under their writer's own term, no older term accepted once a
    newer one began."""
    problems: list[str] = []
    leaders: dict[int, str] = {}
    for t in terms:
        if leaders.setdefault(t.term, t.leader) != t.leader:
            problems.append(f"term {t.term} claimed by both {leaders[t.term]} and {t.leader}")
    starts = sorted((t.started_at, t.term) for t in terms)
    for w in sorted(writes, key=lambda w: w.at):
        if not w.accepted:
            continue
        holder = leaders.get(w.term)
        if holder is None:
            problems.append(f"write by {w.writer} at {w.at:.3f} carries term {w.term}, which no leader took")
            continue
        if holder != w.writer:
            problems.append(f"write by {w.writer} at {w.at:.3f} carries term {w.term}, held by {holder}")
        newer = [term for started, term in starts if started <= w.at and term > w.term]
        if newer:
            problems.append(
                f"write by {w.writer} under term {w.term} accepted at {w.at:.3f}, after term "
                f"{min(newer)} ({leaders[min(newer)]}) began: not fenced" + (f" ({w.what})" if w.what else "")
            )
    return problems


def recovery_problems(heals: Sequence[Heal], bound_s: float) -> tuple[list[str], float]:
    """Services slower than ``bound_s`` to serve after a heal (or never), and the slowest time."""
    problems: list[str] = []
    slowest = 0.0
    for heal in heals:
        for service, at in sorted(heal.serving_at.items()):
            if at is None:
                problems.append(f"{service} never served again after {heal.fault} was healed")
                continue
            took = max(0.0, at - heal.healed_at)
            slowest = max(slowest, took)
            if took > bound_s:
                problems.append(
                    f"{service} served again {took:.1f} s after {heal.fault} was healed (bound {bound_s:g} s)"
                )
    return problems, slowest
