"""What the gateways share of the tenants' limits (:mod:`.tenant_quota`), through etcd.

Without it each gateway enforced the tenants file on its own traffic, so N gateways let a tenant
have N times its limits. With etcd (``--etcd-endpoints``) and some tenant limited:

- ``max_concurrent_requests`` N is N slots in etcd, ``<prefix>/gateway/slots/<tenant>/<0..N-1>``,
  taken by a transaction requiring the slot free and freed when the generation ends
  (:class:`~services.runtime.etcd.leased_slots.LeasedSlots`, as the adapter store's upload
  slots): exactly N across every gateway, for one etcd transaction at admission and one at the
  end, paid only by generations of tenants with a concurrency limit. A gateway hands a slot it
  holds straight to its own oldest waiter (no etcd call); waiters learn of slots freed by other
  gateways by trying again every ``retry_s``.
- ``tokens_per_minute``: each gateway refills its bucket at ``1 / live gateways`` of the rate,
  with that share of the bucket, the live gateways counted from their membership keys
  (``<prefix>/members/gateway/``).

A gateway that cannot reach etcd refuses new generations of tenants with a concurrency limit
(UNAVAILABLE naming the tenant) rather than admitting on its own, which would be the N-fold error
again; what it holds it keeps while its lease surely lives. Its token share stays its last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

from services.runtime.errors import Unavailable
from services.runtime.etcd.leased_slots import HeldSlot, LeasedSlots
from services.runtime.etcd.membership import (
    EtcdConnection,
    MembershipConfig,
    follow,
    watch_members,
)
from services.runtime.process.tasks import cancel_and_wait

log = logging.getLogger("loramesh.gateway.quota")

SLOT_RETRY_S = 0.2
"""How often a gateway whose tenant has generations waiting tries again for a slot freed by
another gateway: a waiter there is served at most this much later than a free slot."""
SLOT_THREADS = 8
"""Threads taking and freeing slots (each waits on one etcd call run on the gateway's loop): a
pool of their own, so that admissions never queue behind other work of the default executor."""


class SharedQuota:
    """One gateway's hold on the slots, and its count of the live gateways."""

    def __init__(self, config: MembershipConfig, holder_id: str, retry_s: float = SLOT_RETRY_S):
        """``holder_id``: this gateway, written in the slots it holds."""
        self.config = config
        self.retry_s = retry_s
        self._prefix = f"{config.key_prefix}/gateway/slots/"
        self._conn = EtcdConnection(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = LeasedSlots(self._call, holder_id, config.ttl_s, "generation")
        self._threads = ThreadPoolExecutor(SLOT_THREADS, thread_name_prefix="quota-slots")
        self._closed = False
        self._watch: asyncio.Task[None] | None = None
        self.gateways = 0
        """Live gateways, as last listed (0: not yet listed)."""

    async def start(self) -> None:
        """Follow the live gateways (on the running loop, which runs the etcd calls too), waiting
        for the first listing up to a call timeout: a gateway's first token buckets take their
        share from it (until listed, the whole bucket, as if alone)."""
        self._loop = asyncio.get_running_loop()
        listed = asyncio.Event()
        self._watch = self._loop.create_task(
            follow(watch_members(self.config, "gateway"), self._count, listed), name="gateway-count"
        )
        try:
            await asyncio.wait_for(listed.wait(), self.config.call_timeout_s)
        except TimeoutError:
            log.warning("the live gateways are not listed yet: token shares follow once they are")

    def _count(self, members: dict) -> None:
        self.gateways = len(members)

    @property
    def share(self) -> float:
        """This gateway's share of a tenant's tokens per minute: one of the live gateways'."""
        return 1.0 / max(self.gateways, 1)

    def lease_alive(self) -> bool:
        """Whether the slots held surely still stand (one may be handed to another generation)."""
        return self._slots.lease_alive()

    async def take(self, tenant: str, limit: int) -> HeldSlot | None:
        """One of ``tenant``'s ``limit`` slots, or None when every gateway's together hold them
        all; Unavailable naming the tenant when etcd does not answer."""
        assert self._loop is not None, "SharedQuota.start first"
        taking = self._loop.run_in_executor(
            self._threads, self._slots.take, self._prefix + quote(tenant, safe="") + "/", limit
        )
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:
            taking.add_done_callback(self._release_taken)  # the caller went: the slot is not its
            raise
        except Unavailable as error:
            raise Unavailable(
                f"tenant {tenant!r} has a max_concurrent_requests limit shared by the gateways "
                f"through etcd, which this gateway cannot reach ({error}); retry shortly"
            ) from None

    def release(self, slot: HeldSlot) -> None:
        """Free ``slot`` in etcd, off the loop (its lease frees it if that fails)."""
        if self._loop is not None and not self._closed:
            self._loop.run_in_executor(self._threads, slot.release)

    def _release_taken(self, taking: asyncio.Future) -> None:
        if not taking.cancelled() and taking.exception() is None and taking.result() is not None:
            self.release(taking.result())

    def _call(self, fn, what: str):
        """One etcd call on the gateway's loop, from a slot thread (:class:`LeasedSlots`)."""
        if self._loop is None:
            raise Unavailable(f"cannot {what}: the gateway's quota is not started")
        return asyncio.run_coroutine_threadsafe(self._conn.checked_call(fn, what), self._loop).result()

    async def close(self) -> None:
        """Stop counting the gateways and revoke the slots' lease: the slots held are free at once
        (generations ending later have nothing to free)."""
        self._closed = True
        if self._watch is not None:
            await cancel_and_wait([self._watch])
        await asyncio.to_thread(self._slots.close)
        await asyncio.to_thread(self._threads.shutdown)
        with contextlib.suppress(Exception):
            await self._conn.close()
