"""A new version of an adapter this worker serves is pulled as soon as it is published, before
any request asks for it: a training loop's next requests then find it in host RAM, and in the
pool when there is room.

The worker follows the catalog's rows in etcd (the watch every gateway follows too). A row
created for a name that one of the worker's host copies goes by, and that a request used here
within ``--prefetch-versions-s``, starts its pull, then its page-in (the engine's preload,
which only evicts idle adapters). The pull parses on a thread of low priority, as the page-in
copies: the running batch's steps go first. The work is bounded: one pull per name at a time, and of the
versions published meanwhile only the newest is pulled next; names no request uses any more
cost nothing, and neither do versions published faster than requests use them: a name's next
version is pulled ahead only once a request used the name here since its last pull ahead began
(a training loop's publish, then its rollouts, pulls every version; a burst of publishes with no
request between them pulls one, so it takes no CPU from the other adapters' streams). A pull
that fails is only logged: the first request for that version pulls it then, as without
prefetching.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import aetcd

from services.gpu_worker.adapter_loader import AdapterLoader
from services.runtime.errors import DomainError
from services.runtime.etcd.adapter_catalog_rows import catalog_rows
from services.runtime.etcd.membership import EtcdConnection, MembershipConfig
from services.runtime.etcd.prefix_follower import ListingPage, follow_prefix

log = logging.getLogger("loramesh.worker.adapters")

RETRY_S = 1.0
"""Wait before following the rows again after the watch broke (etcd unreachable, compacted)."""


class VersionPrefetch:
    """Decides which published versions to pull, and pulls them one per name at a time."""

    def __init__(
        self,
        loader: AdapterLoader,
        preload: Callable[[str], None],
        within_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``preload``: pages a pulled adapter into the pool when there is room (the engine's);
        ``within_s``: how recently a request must have used a version of the name here."""
        self.loader = loader
        self.preload = preload
        self.within_s = within_s
        self.clock = clock
        self._pulling: dict[str, asyncio.Task] = {}
        """Per ``owner/name``, the pull under way."""
        self._next: dict[str, tuple[int, str]] = {}
        """Per ``owner/name``, the newest version published while a pull was under way."""
        self._began: dict[str, float] = {}
        """Per ``owner/name``, when its last pull ahead began (the clock's time)."""
        self.started: list[str] = []
        """The ids pulled so far, in order (read by tests and the metrics)."""

    def published(self, row: dict) -> bool:
        """A catalog row was created: whether its version will be pulled here."""
        name, adapter_id, version = f"{row['owner']}/{row['name']}", row["id"], int(row.get("version", 0))
        if adapter_id in self.loader.engine.host_adapters or not self._serves(name):
            return False
        if name in self._pulling:
            if version >= self._next.get(name, (-1, ""))[0]:
                self._next[name] = (version, adapter_id)
            return True
        self._start(name, adapter_id)
        return True

    def _serves(self, name: str) -> bool:
        """Whether a request used a host copy of a version of ``name`` here within ``within_s``,
        and since the name's last pull ahead began."""
        since = max(self.clock() - self.within_s, self._began.get(name, float("-inf")))
        loader = self.loader
        return any(
            (used := loader.last_used(a)) is not None and used >= since and loader.public_name(a) == name
            for a in list(loader.engine.host_adapters)
        )

    def _start(self, name: str, adapter_id: str) -> None:
        self.started.append(adapter_id)
        self._began[name] = self.clock()
        self._pulling[name] = asyncio.create_task(self._pull(name, adapter_id))

    async def _pull(self, name: str, adapter_id: str) -> None:
        try:
            await self.loader.ensure(adapter_id, background=True)
            self.preload(adapter_id)
        except DomainError as error:
            log.info("prefetch of %s (%s) failed: %s; its first request pulls it", adapter_id, name, error)
        finally:
            following = self._next.pop(name, None)
            if following is not None and following[1] not in self.loader.engine.host_adapters:
                self._start(name, following[1])
            else:
                del self._pulling[name]

    async def close(self) -> None:
        tasks = list(self._pulling.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def follow_publishes(
    membership: MembershipConfig, prefetch: VersionPrefetch, listed: asyncio.Event | None = None
) -> None:
    """Hand every catalog row created from now on to ``prefetch``, until cancelled; a broken
    watch is followed again after :data:`RETRY_S` (rows created meanwhile are not pulled early:
    their first requests pull them). ``listed``: set once the rows that exist are listed, from
    when every row created is handed over."""
    conn = EtcdConnection(membership)
    rows = catalog_rows(membership.key_prefix)
    try:
        while True:
            try:
                async with contextlib.aclosing(follow_prefix(conn, rows)) as updates:
                    async for update in updates:
                        if isinstance(update, ListingPage):
                            if update.last and listed is not None:
                                listed.set()
                            continue  # what exists already was published before this worker looked
                        if update.kind != aetcd.EventKind.PUT:
                            continue
                        if update.kv.version == 1:  # created, not a pin or retention update
                            _hand_over(prefetch, update.kv)
            except Exception as error:  # noqa: BLE001 - any failure (etcd gone, compacted): follow again
                log.info("following published adapter versions broke (%s); again in %.0f s", error, RETRY_S)
                await asyncio.sleep(RETRY_S)
                await conn.reset()
    finally:
        await prefetch.close()
        await conn.close()


def _hand_over(prefetch: VersionPrefetch, kv) -> None:
    try:
        prefetch.published(json.loads(kv.value))
    except (ValueError, KeyError, TypeError) as error:  # a row this worker cannot read: not its
        log.warning("catalog row %s unreadable (%s): not prefetched", kv.key.decode(errors="replace"), error)
