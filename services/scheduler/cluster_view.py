"""The cluster as the scheduler sees it: live gpu_workers, their latest load reports, and what
this scheduler placed on each since that report.

:class:`ClusterView` is the mutable state, owned by the service and fed from etcd (members
under ``/loramesh/members/gpu_worker/``, load reports under ``/loramesh/load/<id>``) and by
:meth:`ClusterView.record_placement`. Policies never see it: they get an immutable
:class:`ClusterSnapshot`, so the same policy runs unchanged over a replayed trace in bench/.

No gRPC and no etcd here: the service translates watch results into plain mappings.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from services.scheduler.prefix_index import PrefixIndex

log = logging.getLogger("loramesh.scheduler.view")

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class WorkerState:
    """One live gpu_worker as of its latest load report."""

    worker_id: str
    """Instance id (the last segment of its etcd member key)."""
    address: str
    """gRPC ``host:port`` the gateway opens ``Worker/Generate`` on."""
    queue: int = 0
    """Requests waiting in the worker (not yet admitted to the running batch)."""
    running: int = 0
    """Requests in the running batch (prefilling or decoding)."""
    free_pages: int = 0
    """Free pages of the unified pool (KV cache and adapter weights share it)."""
    total_pages: int = 0
    """Size of the unified pool in pages."""
    resident_adapters: frozenset[str] = frozenset()
    """Adapters whose weights are in the worker's pool now (no load needed)."""
    tokens_per_s: float = 0.0
    """Tokens the worker generated per second, all requests together (0 when idle)."""
    report_ts: float = 0.0
    """Unix time (s) the load report was written; 0 when the worker has not reported yet."""


@dataclass(frozen=True)
class ClusterSnapshot:
    """An immutable copy of the view at one instant: what a policy decides on.

    ``placed_since_report`` and ``placed_adapters`` are this scheduler's own decisions that the
    worker's latest report cannot show yet: requests sent there (which will queue or run) and
    the adapters of those requests (which will be resident there by the time ours arrives).
    """

    workers: tuple[WorkerState, ...] = ()
    """Live workers, sorted by worker id."""
    placed_since_report: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """worker id -> requests placed there since its latest load report."""
    placed_adapters: Mapping[str, frozenset[str]] = field(default_factory=lambda: _EMPTY)
    """worker id -> adapters of those placements."""
    taken_at: float = 0.0
    """Unix time (s) the snapshot was taken (for report ages)."""
    predicted_output_tokens: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """worker id -> mean predicted length of its unfinished requests, where a length predictor
    runs (``--length-predictor``); absent: the wait model's ``mean_output_tokens``."""
    prefix_hit_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """worker id -> prompt tokens of the request being placed that the worker likely holds in
    its prefix cache (the scheduler's :class:`~services.scheduler.prefix_index.PrefixIndex`);
    absent: none. Only for the one request the snapshot was taken for."""

    def hit_tokens(self, worker_id: str) -> int:
        """Prompt tokens of the request being placed likely cached on ``worker_id``."""
        return self.prefix_hit_tokens.get(worker_id, 0)

    @cached_property
    def _by_id(self) -> dict[str, WorkerState]:
        # Built on first use: policies look workers up once per worker per placement.
        return {w.worker_id: w for w in self.workers}

    def worker(self, worker_id: str) -> WorkerState | None:
        """The worker with this id, or None."""
        return self._by_id.get(worker_id)

    def placed(self, worker_id: str) -> int:
        """Requests placed on ``worker_id`` since its latest report."""
        return self.placed_since_report.get(worker_id, 0)

    def will_have(self, worker_id: str, adapter_id: str) -> bool:
        """``adapter_id`` is resident on the worker or on its way there (placed since the report)."""
        w = self.worker(worker_id)
        if w is not None and adapter_id in w.resident_adapters:
            return True
        return adapter_id in self.placed_adapters.get(worker_id, frozenset())

    def without(self, worker_ids: frozenset[str] | set[str]) -> ClusterSnapshot:
        """The same snapshot restricted to the workers not in ``worker_ids``."""
        if not worker_ids:
            return self
        return replace(self, workers=tuple(w for w in self.workers if w.worker_id not in worker_ids))

    def with_predicted_lengths(self, means: Mapping[str, float]) -> ClusterSnapshot:
        """The same snapshot with the predictor's per-worker mean lengths."""
        return replace(self, predicted_output_tokens=MappingProxyType(dict(means)))

    def with_prefix_hits(self, hit_tokens: Mapping[str, int]) -> ClusterSnapshot:
        """The same snapshot with the likely cached prompt tokens of one request per worker."""
        return replace(self, prefix_hit_tokens=MappingProxyType(dict(hit_tokens)))

    @classmethod
    def of(
        cls,
        workers: list[WorkerState] | tuple[WorkerState, ...],
        placed_since_report: Mapping[str, int] | None = None,
        placed_adapters: Mapping[str, frozenset[str] | set[str]] | None = None,
        taken_at: float = 0.0,
    ) -> ClusterSnapshot:
        """Build a snapshot from plain values (tests, bench replays)."""
        return cls(
            workers=tuple(sorted(workers, key=lambda w: w.worker_id)),
            placed_since_report=MappingProxyType(dict(placed_since_report or {})),
            placed_adapters=MappingProxyType({k: frozenset(v) for k, v in (placed_adapters or {}).items()}),
            taken_at=taken_at,
        )


def _count(report: Mapping[str, Any], key: str) -> int:
    value = report.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return max(0, int(value))


def _rate(report: Mapping[str, Any], key: str) -> float:
    value = report.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return max(0.0, float(value))


def worker_state(worker_id: str, address: str, report: Mapping[str, Any] | None) -> WorkerState:
    """A :class:`WorkerState` from a gpu_worker load report (missing or malformed fields: 0)."""
    report = report or {}
    resident = report.get("resident_adapters", [])
    if not isinstance(resident, list | tuple):
        resident = []
    return WorkerState(
        worker_id=worker_id,
        address=address,
        queue=_count(report, "queue"),
        running=_count(report, "running"),
        free_pages=_count(report, "free_pages"),
        total_pages=_count(report, "total_pages"),
        resident_adapters=frozenset(str(a) for a in resident),
        tokens_per_s=_rate(report, "tokens_per_s"),
        report_ts=_rate(report, "ts"),
    )


class ClusterView:
    """The scheduler's mutable cluster state. Not thread-safe: use it from one event loop.

    - :meth:`update_members` replaces the set of live workers; a worker whose member key is gone
      is dropped at once, with its placements;
    - :meth:`update_loads` takes the current load reports; a report with a newer ``ts`` than the
      one held resets that worker's placed-since-report count (the report now includes them);
    - :meth:`record_placement` counts one request placed on a worker, and with a
      ``prefix_index`` (prefix-aware placement) remembers its prompt blocks there; a worker that
      leaves takes its blocks with it.
    """

    def __init__(self, clock: Callable[[], float] = time.time, prefix_index: PrefixIndex | None = None):
        self._clock = clock
        self.prefix_index = prefix_index
        """Where this scheduler sent which prompt blocks; None: not kept (no policy reads it)."""
        self._addresses: dict[str, str] = {}
        self._reports: dict[str, Mapping[str, Any]] = {}
        self._report_ts: dict[str, float] = {}
        self._placed: dict[str, int] = {}
        self._placed_adapters: dict[str, set[str]] = {}
        self._states: dict[str, WorkerState] = {}
        """Parsed reports, rebuilt only when members or reports change (snapshots are per request)."""
        self.placements_total = 0
        """Requests placed by this scheduler since it started."""
        self.prefix_hit_placements = 0
        """Of those, placed where the prefix index said part of the prompt is likely cached."""
        self.prefix_hit_tokens = 0
        """The prompt tokens those placements likely found cached, all together."""

    def __len__(self) -> int:
        return len(self._addresses)

    def update_members(self, addresses: Mapping[str, str]) -> None:
        """Replace the live worker set: ``{worker_id: address}``."""
        gone = self._addresses.keys() - addresses.keys()
        for worker_id in gone:
            self._placed.pop(worker_id, None)
            self._placed_adapters.pop(worker_id, None)
            if self.prefix_index is not None:
                self.prefix_index.forget(worker_id)
            log.info("worker %s left the cluster", worker_id)
        for worker_id in addresses.keys() - self._addresses.keys():
            log.info("worker %s joined at %s", worker_id, addresses[worker_id])
        self._addresses = dict(addresses)
        self._states = {}

    def update_loads(self, reports: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the load reports: ``{worker_id: report}`` (reports of non-members are kept
        for when the member key shows up, and ignored until then)."""
        for worker_id, report in reports.items():
            ts = _rate(report, "ts")
            previous = self._report_ts.get(worker_id)
            if previous is None or ts > previous or (ts == 0.0 and report != self._reports.get(worker_id)):
                self._placed.pop(worker_id, None)
                self._placed_adapters.pop(worker_id, None)
            self._report_ts[worker_id] = ts
        for worker_id in self._reports.keys() - reports.keys():
            self._report_ts.pop(worker_id, None)
        self._reports = dict(reports)
        self._states = {}
        if self.prefix_index is not None:  # with the reports (every ≤1 s), not per placement
            self.prefix_index.expire()

    def record_placement(
        self,
        worker_id: str,
        adapter_id: str = "",
        prefix_blocks: Sequence[bytes] = (),
        cached_prefix_tokens: int = 0,
    ) -> None:
        """Count one request placed on ``worker_id`` (for ``adapter_id``; empty: base model),
        whose prompt's blocks are ``prefix_blocks`` (the worker will cache them), of which the
        index said ``cached_prefix_tokens`` tokens are likely cached there."""
        if worker_id not in self._addresses:
            return  # the worker left between the snapshot and now: nothing to account for
        self._placed[worker_id] = self._placed.get(worker_id, 0) + 1
        if adapter_id:
            self._placed_adapters.setdefault(worker_id, set()).add(adapter_id)
        if self.prefix_index is not None:
            self.prefix_index.record(worker_id, prefix_blocks)
        if cached_prefix_tokens > 0:
            self.prefix_hit_placements += 1
            self.prefix_hit_tokens += cached_prefix_tokens
        self.placements_total += 1

    def snapshot_for(
        self, prefix_blocks: Sequence[bytes], block_tokens: int, prompt_tokens: int
    ) -> ClusterSnapshot:
        """:meth:`snapshot` with the prompt tokens a request whose blocks are ``prefix_blocks``
        likely finds cached on each worker: whole blocks, less the prompt's last token, which a
        worker always computes. A plain snapshot without a prefix index or blocks."""
        snapshot = self.snapshot()
        if self.prefix_index is None or not prefix_blocks or block_tokens <= 0:
            return snapshot
        blocks = self.prefix_index.hits(self._addresses, prefix_blocks)
        most = max(0, prompt_tokens - 1) if prompt_tokens else len(prefix_blocks) * block_tokens
        return snapshot.with_prefix_hits({w: min(n * block_tokens, most) for w, n in blocks.items()})

    def snapshot(self) -> ClusterSnapshot:
        """An immutable copy of the current state."""
        if not self._states:
            self._states = {
                worker_id: worker_state(worker_id, self._addresses[worker_id], self._reports.get(worker_id))
                for worker_id in sorted(self._addresses)
            }
        workers = tuple(self._states.values())
        return ClusterSnapshot(
            workers=workers,
            placed_since_report=MappingProxyType(dict(self._placed)),
            placed_adapters=MappingProxyType({k: frozenset(v) for k, v in self._placed_adapters.items()}),
            taken_at=self._clock(),
        )
