"""Brings adapters onto the worker and keeps their host copies within a RAM budget.

Fetch happens once even when many requests ask at the same time, parsing runs off the event
loop, and the host copy is handed to the engine. S-LoRA §5.2's prefetch: a request's adapter
starts moving as soon as the request arrives, or earlier via ``Prefetch``.

Host copies are reference counted (one reference per request between :meth:`acquire` and
:meth:`release`); when their bytes exceed the budget, unreferenced ones are dropped in the
eviction policy's order (``--eviction-policy``: least recently used first by default) and
fetched again (from the store's RAM tier or disk) when next asked for. Pinned adapters are never
dropped: they count against the budget, and pins beyond it hold their copies over it.

Pins reach the loader with each fetch (the store's FetchAdapter header) and as the whole pinned
set (:meth:`AdapterLoader.set_pinned`, which the worker calls every ``--pin-refresh-s``), and
the loader passes them on to the engine's device residency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from services.gpu_worker.adapter_source import AdapterSource, FetchedAdapter
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.side_threads import side_thread_pool
from services.gpu_worker.lora.host_adapter import HostAdapter, parse_peft_adapter
from services.runtime.eviction import EvictionPolicy, LRUEviction, set_pins

log = logging.getLogger("loramesh.worker.adapters")


class AdapterLoader:
    def __init__(
        self,
        source: AdapterSource,
        engine: Engine,
        dtype: torch.dtype,
        host_budget_bytes: int | None = None,
        eviction: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``host_budget_bytes``: RAM for host copies of adapters; None: unbounded.
        ``eviction``: the order unreferenced host copies are dropped in (default least recently
        used first); ``clock``: when a request last used each adapter (:meth:`last_used`)."""
        self.source = source
        self.engine = engine
        self.dtype = dtype
        self.host_budget_bytes = host_budget_bytes
        self._inflight: dict[str, asyncio.Task[HostAdapter]] = {}
        self._refs: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        """Host copies this loader added, with their sizes."""
        self._eviction = eviction or LRUEviction()
        self._clock = clock
        self._background: ThreadPoolExecutor | None = None
        """The thread background pulls parse on, at the page-in copier's low priority (made
        at the first)."""
        self._used: dict[str, float] = {}
        """When a request last acquired each adapter (kept for host copies only)."""
        self.fetches = 0
        """Adapters pulled from the source so far (re-fetches after a drop included)."""
        self.on_loaded: Callable[[float], None] | None = None
        """Told the seconds each pull took, from asking the source to the host copy ready."""

    @property
    def host_bytes(self) -> int:
        return sum(self._sizes.values())

    def set_pinned(self, adapter_ids: Iterable[str]) -> None:
        """Make ``adapter_ids`` the adapters pinned here, on the host and in the engine's pool
        (copies an unpin lets go are dropped when over the budget)."""
        adapter_ids = frozenset(adapter_ids)
        if adapter_ids == self._eviction.pinned():
            return
        set_pins(self._eviction, adapter_ids)
        self.engine.set_pinned_adapters(self._eviction.pinned())
        self._shrink()

    def pinned_ids(self) -> frozenset[str]:
        """The adapters pinned here now (the event loop's, as every other call)."""
        return self._eviction.pinned()

    async def ensure(self, adapter_id: str, background: bool = False) -> HostAdapter:
        """The adapter's host copy, pulling it if this worker does not have it now.
        ``background``: no request waits for it (a published version pulled ahead): a pull it
        starts asks the store's replicas for it as just published (the one that committed it
        first) and parses on a thread that gives way to the engine's steps (a request that
        joins the pull then waits for that thread too)."""
        existing = self.engine.host_adapters.get(adapter_id)
        if existing is not None:
            if adapter_id in self._sizes:
                self._eviction.touch(adapter_id)
            return existing
        task = self._inflight.get(adapter_id)
        if task is None:
            task = asyncio.create_task(self._pull(adapter_id, background))
            self._inflight[adapter_id] = task
            task.add_done_callback(lambda _: self._inflight.pop(adapter_id, None))
        return await asyncio.shield(task)

    async def acquire(self, adapter_id: str) -> HostAdapter:
        """:meth:`ensure`, holding a reference so the host copy stays until :meth:`release`."""
        self._refs[adapter_id] = self._refs.get(adapter_id, 0) + 1
        self._used[adapter_id] = self._clock()
        try:
            return await self.ensure(adapter_id)
        except BaseException:
            self.release(adapter_id)
            raise

    def last_used(self, adapter_id: str) -> float | None:
        """When a request last acquired ``adapter_id`` (the clock's time), while its host copy
        is here; None if none did since it was pulled."""
        return self._used.get(adapter_id)

    def public_name(self, adapter_id: str) -> str:
        """The name users know ``adapter_id`` by (the store's ``owner/name``, a directory's name)."""
        return self.source.public_name(adapter_id)

    def fetch_waiters(self) -> dict[str, int]:
        """Requests waiting for their adapter's host copy, per adapter being pulled: queued on
        this worker, though not yet handed to the engine."""
        return {a: self._refs[a] for a in self._inflight if self._refs.get(a)}

    def release(self, adapter_id: str) -> None:
        count = self._refs.get(adapter_id, 0)
        if count <= 0:
            raise RuntimeError(f"adapter {adapter_id} released more often than acquired")
        if count == 1:
            del self._refs[adapter_id]
            self._shrink()
        else:
            self._refs[adapter_id] = count - 1

    def prefetch(self, adapter_ids: list[str]) -> list[str]:
        started = []
        for adapter_id in adapter_ids:
            if adapter_id in self.engine.host_adapters or adapter_id in self._inflight:
                continue
            task = asyncio.create_task(self.ensure(adapter_id))
            task.add_done_callback(_log_failure(adapter_id))
            started.append(adapter_id)
        return started

    async def _pull(self, adapter_id: str, background: bool = False) -> HostAdapter:
        started = time.perf_counter()
        fetched = await self.source.fetch(adapter_id, just_published=background)
        pinned = self._eviction.pinned()
        if fetched.pinned != (adapter_id in pinned):  # the store's word now: fresher than a refresh
            self.set_pinned(pinned | {adapter_id} if fetched.pinned else pinned - {adapter_id})
        # Parsing and the engine's footprint of it (a walk over every module) both run on the
        # parse thread: neither holds the event loop (engine.add_adapter is thread-safe).
        if background:
            parse = asyncio.get_running_loop().run_in_executor(
                self._background_parses(), self._parse_and_add, adapter_id, fetched
            )
            adapter = await parse
        else:
            adapter = await asyncio.to_thread(self._parse_and_add, adapter_id, fetched)
        if self.on_loaded is not None:
            self.on_loaded(time.perf_counter() - started)
        self.fetches += 1
        self._sizes[adapter_id] = adapter.nbytes
        self._eviction.touch(adapter_id)
        self._shrink()
        self._warn_if_pins_overflow()
        log.debug(
            "adapter %s on this worker (max rank %d, %d bytes)", adapter_id, adapter.max_rank, adapter.nbytes
        )
        return adapter

    def _background_parses(self) -> ThreadPoolExecutor:
        if self._background is None:
            self._background = side_thread_pool(1, "adapter-prefetch", background=True)
        return self._background

    def _parse_and_add(self, adapter_id: str, fetched: FetchedAdapter) -> HostAdapter:
        # A pool in host memory converts a narrower host copy exactly as it copies it in.
        narrow = self.engine.pool.device.type == "cpu"
        adapter = parse_peft_adapter(
            adapter_id, fetched.config, fetched.weights, self.dtype, fetched.weights_sha256, narrow
        )
        self.engine.add_adapter(adapter)
        return adapter

    def _warn_if_pins_overflow(self) -> None:
        pinned = self._eviction.pinned()
        pinned_bytes = sum(size for adapter_id, size in self._sizes.items() if adapter_id in pinned)
        if self.host_budget_bytes is not None and pinned_bytes > self.host_budget_bytes:
            log.warning(
                "pinned adapters' host copies take %d bytes, over the --host-cache-mib budget of %d "
                "bytes: they are all kept; unpin some or raise the budget",
                pinned_bytes, self.host_budget_bytes,
            )  # fmt: skip

    def _shrink(self) -> None:
        """Drop unreferenced, unpinned host copies, in eviction order, while over the budget."""
        if self.host_budget_bytes is None:
            return
        total = self.host_bytes
        if total <= self.host_budget_bytes:
            return
        idle = [a for a in self._sizes if not self._refs.get(a) and a not in self._inflight]
        for adapter_id in self._eviction.victims(idle):
            if total <= self.host_budget_bytes:
                break
            total -= self._sizes.pop(adapter_id)
            self._used.pop(adapter_id, None)
            self._eviction.remove(adapter_id)
            self.engine.remove_adapter(adapter_id)


def _log_failure(adapter_id: str):
    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefetch of adapter %s failed: %s", adapter_id, task.exception())

    return done
