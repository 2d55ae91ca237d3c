"""How a pin reaches a worker that already holds the adapter: every ``--pin-refresh-s`` the worker
reads the store's whole pinned set (``ListPinnedAdapters``, a few ids) and makes it the pinned set
of its host cache and its pool. An adapter fetched meanwhile brings its pin in the fetch header,
so a pin set before the fetch holds from the first load; a pin or an unpin set after it takes
effect within one period. The store stays the one source of truth: nothing to reconcile after a
restart of either, and a store out of reach leaves the last set in force."""

from __future__ import annotations

import asyncio
import logging

from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import AdapterSource
from services.runtime.errors import DomainError

log = logging.getLogger("loramesh.worker.adapters")


async def refresh_pins(source: AdapterSource, loader: AdapterLoader, interval_s: float) -> None:
    """Apply the source's pinned set to ``loader`` now and every ``interval_s``, until cancelled."""
    failing = False
    while True:
        try:
            loader.set_pinned(await source.pinned_ids())
            if failing:
                log.info("pinned adapters read again from the adapter store")
            failing = False
        except DomainError as error:
            if not failing:
                log.warning("cannot read the pinned adapters (%s): the last set stays in force", error)
            failing = True
        await asyncio.sleep(interval_s)
