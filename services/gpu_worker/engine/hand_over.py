"""Work other threads hand to the engine thread: new requests, cancellations, preloads, workers
gone, and calls to run between steps (DGFM's recalls, hand-offs). Each is queued under one lock
and wakes the engine; the engine thread takes everything queued at the start of a step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from services.gpu_worker.engine.request import EngineRequest
from services.gpu_worker.engine.request_lifecycle import EventSink
from services.runtime.errors import AlreadyExists

T = TypeVar("T")


@dataclass
class HandedOver:
    """What other threads handed over since the engine thread last took it."""

    requests: list[tuple[EngineRequest, EventSink]] = field(default_factory=list)
    cancels: set[str] = field(default_factory=set)
    preloads: list[str] = field(default_factory=list)
    gone_workers: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests or self.cancels or self.preloads or self.gone_workers)


class HandOver:
    """The engine's mailbox (any thread in, the engine thread out)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Also guards the engine's host adapters, which other threads add and remove."""
        self.wakeup = threading.Event()
        self._pending = HandedOver()
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._active: set[str] = set()
        """Ids of the requests handed over and not ended: a second submit of one is refused."""

    def request(self, request: EngineRequest, sink: EventSink) -> None:
        with self.lock:
            if request.request_id in self._active:
                raise AlreadyExists(f"request id {request.request_id!r} is already running on this worker")
            self._active.add(request.request_id)
            self._pending.requests.append((request, sink))
        self.wakeup.set()

    def cancel(self, request_id: str) -> None:
        with self.lock:
            self._pending.cancels.add(request_id)
        self.wakeup.set()

    def preload(self, adapter_id: str) -> None:
        with self.lock:
            self._pending.preloads.append(adapter_id)
        self.wakeup.set()

    def worker_gone(self, worker_id: str) -> None:
        with self.lock:
            self._pending.gone_workers.append(worker_id)
        self.wakeup.set()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self.lock:
            self._calls.append((fn, future))
        self.wakeup.set()
        return future

    def ended(self, request_id: str) -> None:
        """A request ended on the engine: its id may be submitted again."""
        with self.lock:
            self._active.discard(request_id)

    def queued_adapters(self) -> list[str | None]:
        """The adapter of each request handed over and not taken yet (None: the base model)."""
        with self.lock:
            return [request.spec.adapter_id for request, _ in self._pending.requests]

    def queued_requests(self) -> int:
        return len(self._pending.requests)

    def pending(self) -> bool:
        return bool(self._pending or self._calls)

    def take(self) -> HandedOver:
        """Everything handed over but the calls (engine thread)."""
        with self.lock:
            taken, self._pending = self._pending, HandedOver()
        return taken

    def run_calls(self) -> None:
        """Run the calls handed over, each future getting its result or its error (engine thread)."""
        with self.lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as error:  # noqa: BLE001 - the caller gets it; the engine goes on
                future.set_exception(error)
