"""Per-tenant limits, enforced by the gateway's core for every generation, whichever front end
(gRPC, the OpenAI API, LoRAX's routes) it came through.

Two limits, each configured per tenant in the tenants file (``"tenants"``; ``"*"`` for every
tenant not named; :mod:`services.runtime.tenants_file`; docs/operations.md, "Tenants and
quotas"), each off (0) by default:

- ``max_concurrent_requests``: generations of the tenant in flight at once. Each choice of an
  OpenAI request with ``n`` > 1 is one generation. Past the limit a generation waits for a slot,
  first come first served, in a waiting room of ``max_waiting_requests`` places (as many as
  ``max_concurrent_requests`` unless set; 0: nobody waits): a freed slot goes to the oldest
  waiter, never to a newcomer or a retry that happened to ask first, so a client running a few
  more streams than its limit is served in turn instead of being refused until its retries run
  out. A generation that finds the room full is refused with a retry hint of
  :data:`CONCURRENCY_RETRY_AFTER_S` (when a generation in flight ends is not known in advance).
- ``tokens_per_minute``: prompt plus generated tokens. A token bucket holding
  ``tokens_per_minute × window_s / 60`` tokens (the whole minute's budget with the default
  60 s window), full at first, refilled continuously at ``tokens_per_minute / 60`` per second.
  A generation is charged at admission with its largest possible cost (prompt + ``max_tokens``)
  and refunded when it ends down to what it used (prompt + tokens generated; nothing when it
  failed before its first delta). The retry hint is when the bucket will hold that charge after
  those of the requests refused before it still to come back (:meth:`_Bucket.queue_wait_s`). A
  request larger than the whole bucket is admitted once the bucket is full, and leaves it in
  debt, so no request is refused forever.

Refusals are :class:`~services.runtime.errors.ResourceExhausted` with ``retry_after_s``: HTTP
429 with ``Retry-After`` (and ``retry-after-ms``), gRPC ``RESOURCE_EXHAUSTED`` with the
``retry-after-s`` trailing metadata. The clock is injected, so tests move time instead of
sleeping.

With several gateways sharing etcd (:mod:`.shared_quota`), the limits hold across them all: a
generation of a tenant with ``max_concurrent_requests`` N takes one of the tenant's N slots in
etcd, and each gateway's bucket holds and refills its share (one of the live gateways') of the
tenant's tokens. The waiting room stays each gateway's own: a freed slot goes to the oldest waiter
of the gateway that held it, and waiters of the others try again for one every
:data:`~.shared_quota.SLOT_RETRY_S`. Without etcd the counts are this gateway's alone.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.shared_quota import SharedQuota
from services.runtime.errors import ResourceExhausted, Unavailable
from services.runtime.etcd.leased_slots import HeldSlot
from services.runtime.tenants_file import ALL_TENANTS, UNLIMITED, QuotaConfig, TenantLimits

CONCURRENCY_RETRY_AFTER_S = 1.0
"""The retry hint of a refusal for too many generations in flight: HTTP's smallest."""
_SLACK = 1e-6
"""Tokens of rounding error forgiven when a bucket is compared with a charge."""


@dataclass
class _Bucket:
    """A tenant's tokens per minute."""

    capacity: float
    rate_per_s: float
    level: float
    updated: float
    queue_until: float = 0.0
    """When the last request refused so far was told to come back (its charge in the bucket)."""
    share: float = 1.0
    """The part of the tenant's tokens this gateway's bucket holds and refills (:meth:`rescale`)."""

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def rescale(self, now: float, share: float) -> None:
        """Hold and refill ``share`` of the tenant's tokens from ``now``: a smaller share takes
        tokens above its bucket away at once, a larger one fills only at its rate, so the gateways
        together never hold more than the whole bucket once each has its share."""
        self.refill(now)
        ratio = share / self.share
        self.capacity *= ratio
        self.rate_per_s *= ratio
        self.level = min(self.level, self.capacity)
        self.share = share

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds ``need`` tokens (0: it does), up to whole ms."""
        deficit = need - self.level
        if deficit <= _SLACK:
            return 0.0
        return max(math.ceil(deficit / self.rate_per_s * 1000 - _SLACK), 1) / 1000

    def queue_wait_s(self, now: float, need: float) -> float:
        """The retry hint of a request refused now for ``need`` tokens: after the requests refused
        before it that are still to come back, each hint one charge after the last, so clients
        refused together come back one by one, each to a bucket holding its charge, instead of
        all at the one moment the first of them fits (where all but one are refused again, round
        after round, until some run out of retries)."""
        wait_s = self.wait_s(need)
        if self.queue_until > now:
            turn = math.ceil((self.queue_until - now + need / self.rate_per_s) * 1000 - _SLACK) / 1000
            wait_s = max(wait_s, turn)
        self.queue_until = now + wait_s
        return wait_s


class Admission:
    """One admitted generation: it holds a slot and its charge until :meth:`settle`."""

    def __init__(self, quota: TenantQuota | None, tenant: str, charged: int, slot: HeldSlot | None = None):
        self._quota, self._tenant, self._charged, self._slot = quota, tenant, charged, slot

    def settle(self, used_tokens: int) -> None:
        """The generation ended having used ``used_tokens`` (prompt + generated): free its slot and
        refund what it was charged beyond that. Later calls do nothing."""
        quota, self._quota = self._quota, None
        if quota is not None:
            quota._settle(self._tenant, self._charged, used_tokens, self._slot)


class TenantQuota:
    """Admits a tenant's generations within its limits (:class:`QuotaConfig`)."""

    def __init__(
        self,
        config: QuotaConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        concurrency_retry_after_s: float = CONCURRENCY_RETRY_AFTER_S,
        shared: SharedQuota | None = None,
    ):
        """``clock``: seconds, monotonic (tests pass a fake one). ``shared``: the limits hold
        across the gateways sharing its etcd; None: on this gateway's traffic alone."""
        self.config = config or QuotaConfig()
        self.shared = shared
        self._clock = clock
        self._concurrency_retry_after_s = concurrency_retry_after_s
        self._in_flight: dict[str, int] = {}
        """Generations holding a slot, per tenant (counted only for tenants with limits)."""
        self._waiting: dict[str, deque[asyncio.Future]] = {}
        """Per tenant, the generations waiting for a slot, oldest first."""
        self._buckets: dict[str, _Bucket] = {}
        self._claimers: dict[str, asyncio.Task[None]] = {}
        """Per tenant with waiters, the task trying for slots freed by other gateways."""

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def tenants(self) -> list[str]:
        """The tenants the file limits by name, and any with generations in flight or waiting."""
        named = {tenant for tenant, limits in self.config.limits.items() if limits != UNLIMITED}
        return sorted((named - {ALL_TENANTS}) | set(self._in_flight) | set(self._waiting))

    def reconfigure(self, config: QuotaConfig) -> None:
        """Enforce ``config`` from now on (the tenants file changed). Generations in flight keep
        their slots and charges; a tenant's token bucket takes its new size and rate, keeping what
        it holds up to the new size (a tenant without a token limit now loses its bucket);
        generations waiting for a slot that the new limit frees are admitted now."""
        self.config = config
        for tenant, bucket in list(self._buckets.items()):
            limits = config.for_tenant(tenant)
            if not limits.tokens_per_minute:
                del self._buckets[tenant]
                continue
            bucket.refill(self._clock())
            bucket.capacity, bucket.rate_per_s = self._size(limits, bucket.share)
            bucket.level = min(bucket.level, bucket.capacity)
        if self.shared is not None:
            return  # waiters there take slots freed in etcd, every retry_s, at the new limit
        for tenant in list(self._waiting):
            self._admit_waiting(tenant, config.for_tenant(tenant).max_concurrent_requests)

    def _admit_waiting(self, tenant: str, limit: int) -> None:
        """Give the tenant's oldest waiters the slots ``limit`` leaves free (0: every waiter)."""
        room = self._waiting.get(tenant, deque())
        while room and (not limit or self.in_flight(tenant) < limit):
            turn = room.popleft()
            if not turn.done():
                self._in_flight[tenant] = self.in_flight(tenant) + 1
                turn.set_result(None)
        if not room:
            self._waiting.pop(tenant, None)

    def tokens_left(self, tenant: str) -> float | None:
        """What ``tenant``'s bucket holds now (negative in debt); None when it has no token limit."""
        bucket = self._bucket(tenant, self.config.for_tenant(tenant))
        if bucket is None:
            return None
        bucket.refill(self._clock())
        return bucket.level

    def waiting(self, tenant: str) -> int:
        """The tenant's generations waiting for a slot."""
        return len(self._waiting.get(tenant, ()))

    def admit(self, tenant: str, max_tokens: int) -> Admission:
        """Admit a generation that may use up to ``max_tokens`` (prompt + ``max_tokens``) now, or
        raise :class:`ResourceExhausted` with a retry hint; settle the admission when it ends.
        Over the concurrency limit (or behind generations waiting for a slot) it is refused:
        :meth:`acquire` waits instead."""
        limits = self.config.for_tenant(tenant)
        if limits == UNLIMITED:
            return Admission(None, tenant, 0)
        if self.shared is not None and limits.max_concurrent_requests:
            raise RuntimeError("a slot shared by the gateways is taken by acquire, not admit")
        if self._slot_is_free(tenant, limits):
            self._in_flight[tenant] = self.in_flight(tenant) + 1
        else:
            self._refuse_for_concurrency(tenant)
        return self._charge(tenant, limits, max_tokens)

    async def acquire(self, tenant: str, max_tokens: int) -> Admission:
        """:meth:`admit`, waiting in the tenant's waiting room for a slot when the concurrency limit
        is reached; refused only when the room is full (or for tokens per minute)."""
        limits = self.config.for_tenant(tenant)
        if self.shared is not None and limits.max_concurrent_requests:
            return await self._acquire_shared(tenant, limits, max_tokens)
        if limits == UNLIMITED or self._slot_is_free(tenant, limits):
            return self.admit(tenant, max_tokens)
        await self._await_turn(tenant, self._enter_room(tenant, limits))
        return self._charge(tenant, limits, max_tokens)

    async def _acquire_shared(self, tenant: str, limits: TenantLimits, max_tokens: int) -> Admission:
        """:meth:`acquire` holding one of the tenant's slots in etcd (:mod:`.shared_quota`)."""
        assert self.shared is not None
        slot = None
        if not self._waiting.get(tenant):
            slot = await self.shared.take(tenant, limits.max_concurrent_requests)
            if slot is not None:
                self._in_flight[tenant] = self.in_flight(tenant) + 1
        if slot is None:
            turn = self._enter_room(tenant, limits)
            if tenant not in self._claimers:
                self._claimers[tenant] = asyncio.get_running_loop().create_task(
                    self._claim(tenant), name=f"quota-claim-{tenant}"
                )
            slot = await self._await_turn(tenant, turn)
        return self._charge(tenant, limits, max_tokens, slot)

    def _enter_room(self, tenant: str, limits: TenantLimits) -> asyncio.Future:
        """A place in the tenant's waiting room, last in line (refused when the room is full)."""
        room = self._waiting.setdefault(tenant, deque())
        if len(room) >= limits.waiting_room:
            if not room:
                self._waiting.pop(tenant, None)
            self._refuse_for_concurrency(tenant)
        turn = asyncio.get_running_loop().create_future()
        room.append(turn)
        return turn

    async def _await_turn(self, tenant: str, turn: asyncio.Future) -> HeldSlot | None:
        """Wait for a slot handed over; the slot held in etcd, if shared."""
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                # handed over as the waiter went: the next one takes it
                self._free_slot(tenant, turn.result())
            elif turn in (room := self._waiting.get(tenant, deque())):
                room.remove(turn)
                if not room:
                    self._waiting.pop(tenant, None)
            raise

    async def _claim(self, tenant: str) -> None:
        """While the tenant has waiters here, try every ``retry_s`` for a slot another gateway
        freed, and hand each one taken to the oldest waiter; refuse them all if etcd is away."""
        assert self.shared is not None
        slot = None
        try:
            while self._waiting.get(tenant):
                if slot is None:  # after a slot taken, try again at once: more may be free
                    await asyncio.sleep(self.shared.retry_s)
                limit = self.config.for_tenant(tenant).max_concurrent_requests  # as the file says now
                if not limit:
                    self._admit_waiting(tenant, limit)
                    return
                try:
                    slot = await self.shared.take(tenant, limit)
                except Unavailable as error:
                    for turn in self._waiting.pop(tenant, ()):
                        if not turn.done():
                            turn.set_exception(error)
                    return
                if slot is not None:
                    self._in_flight[tenant] = self.in_flight(tenant) + 1
                    self._free_slot(tenant, slot)
        finally:
            self._claimers.pop(tenant, None)

    def _slot_is_free(self, tenant: str, limits: TenantLimits) -> bool:
        """A slot is free and nobody waits for one (so no newcomer goes ahead of a waiter)."""
        if not limits.max_concurrent_requests:
            return True
        return self.in_flight(tenant) < limits.max_concurrent_requests and not self._waiting.get(tenant)

    def _refuse_for_concurrency(self, tenant: str) -> None:
        limits = self.config.for_tenant(tenant)
        if self.shared is not None:
            in_flight = (
                f"its limit of {limits.max_concurrent_requests} requests in flight across the gateways "
                f"(max_concurrent_requests; {self.in_flight(tenant)} of them here)"
            )
        else:
            in_flight = f"{self.in_flight(tenant)} requests in flight, its limit (max_concurrent_requests)"
        raise ResourceExhausted(
            f"tenant {tenant!r} has {in_flight}, and {self.waiting(tenant)} waiting, its waiting room "
            f"(max_waiting_requests {limits.waiting_room}); retry once one of them has ended",
            retry_after_s=self._concurrency_retry_after_s,
        )

    def _charge(
        self, tenant: str, limits: TenantLimits, max_tokens: int, slot: HeldSlot | None = None
    ) -> Admission:
        """Charge the generation, which holds a slot (``slot`` in etcd, if shared), to the tenant's
        bucket (freeing the slot when the bucket refuses it)."""
        bucket = self._bucket(tenant, limits)
        if bucket is not None:
            now = self._clock()
            bucket.refill(now)
            need = min(max_tokens, bucket.capacity)
            wait_s = bucket.wait_s(need)
            if wait_s > 0:
                wait_s = bucket.queue_wait_s(now, need)
                self._free_slot(tenant, slot)
                raise ResourceExhausted(
                    f"tenant {tenant!r} is over its quota of {limits.tokens_per_minute} tokens per minute: "
                    f"this request may use {max_tokens} tokens (prompt + max_tokens) and "
                    f"{max(int(bucket.level), 0)} are left; retry in {wait_s:.3f} s",
                    retry_after_s=wait_s,
                )
            bucket.level -= max_tokens
        return Admission(self, tenant, max_tokens if bucket is not None else 0, slot)

    def _free_slot(self, tenant: str, slot: HeldSlot | None = None) -> None:
        """A generation let go of its slot: the oldest waiter takes it, else it is free. A slot
        held in etcd is handed over only while its lease surely lives (else it may be another
        gateway's by now): freed, and the waiters try for one again."""
        room = self._waiting.get(tenant)
        if slot is not None and self.shared is not None and not self.shared.lease_alive():
            room = None
        while room:
            turn = room.popleft()
            if not turn.done():
                turn.set_result(slot)
                if not room:
                    self._waiting.pop(tenant, None)
                return
        if not self._waiting.get(tenant):
            self._waiting.pop(tenant, None)
        if slot is not None and self.shared is not None:
            self.shared.release(slot)
        running = self._in_flight.get(tenant, 0) - 1
        if running > 0:
            self._in_flight[tenant] = running
        else:
            self._in_flight.pop(tenant, None)

    def _bucket(self, tenant: str, limits: TenantLimits) -> _Bucket | None:
        if not limits.tokens_per_minute:
            return None
        bucket = self._buckets.get(tenant)
        share = self.shared.share if self.shared is not None else 1.0
        if bucket is None:
            capacity, rate = self._size(limits, share)
            bucket = _Bucket(capacity, rate, capacity, self._clock(), share=share)
            self._buckets[tenant] = bucket
        elif bucket.share != share:
            bucket.rescale(self._clock(), share)
        return bucket

    def _size(self, limits: TenantLimits, share: float) -> tuple[float, float]:
        """A bucket's capacity and refill rate per second for ``share`` of the tenant's tokens."""
        return (
            limits.tokens_per_minute * self.config.window_s / 60.0 * share,
            limits.tokens_per_minute / 60.0 * share,
        )

    def _settle(self, tenant: str, charged: int, used_tokens: int, slot: HeldSlot | None) -> None:
        self._free_slot(tenant, slot)
        bucket = self._bucket(tenant, self.config.for_tenant(tenant))
        if bucket is not None and charged:
            bucket.refill(self._clock())
            bucket.level = min(bucket.capacity, bucket.level + charged - used_tokens)
