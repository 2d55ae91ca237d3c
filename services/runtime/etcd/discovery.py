"""Find another service's address: a fixed one from config, or a live member from etcd, and
call it, trying another member when one is unreachable. Channels are kept per address and reused."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from grpc import aio

from services.runtime.errors import Unavailable
from services.runtime.etcd.membership import MembershipConfig, list_members
from services.runtime.rpc import keepalive
from services.runtime.security.tls import NO_TLS, TLSConfig, aio_channel

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    *keepalive.CHANNEL_OPTIONS,
]


class ChannelPool:
    """One ``grpc.aio`` channel per address, created on first use (mutual TLS when ``tls`` is on)."""

    def __init__(self, tls: TLSConfig = NO_TLS) -> None:
        self.tls = tls
        self._channels: dict[str, aio.Channel] = {}

    def get(self, address: str) -> aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self.tls, CHANNEL_OPTIONS)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


LOOKUP_ATTEMPTS = 3
"""etcd reads a lookup tries, each bounded by the membership call timeout, before the caller gets
UNAVAILABLE: on a saturated machine one read can miss its timeout while etcd is fine."""

MEMBER_TRIES = 3
"""Most members one call tries (:meth:`ServiceLocator.on_live_member`). A member killed
abruptly stays listed until its lease expires (up to its TTL), so a call may meet it first."""

ANSWER_WITHIN_S = 10.0
"""How long a read waits for a member's first answer before it is made on another member (the
last member tried gets the call's whole deadline): a member that is hung (stopped, or its host
gone without a reset) holds a call until keepalive gives its connection up, up to 30 s
(:mod:`services.runtime.rpc.keepalive`), which is as long as a read's whole deadline. A read's
first answer comes from a member's memory, or after one blob read."""

T = TypeVar("T")


class MemberUnavailable(Unavailable):
    """One member could not be reached or could not answer: another member may."""


async def first_answer(answer: Awaitable[T], within_s: float | None, what: str) -> T:
    """``answer`` (a call, or the read of its first message) awaited; :class:`MemberUnavailable`
    naming ``what`` when it has not come within ``within_s`` (the call is cancelled). None: no
    bound but the call's own deadline."""
    try:
        async with asyncio.timeout(within_s):
            return await answer
    except TimeoutError:
        if within_s is None:
            raise
        raise MemberUnavailable(f"{what}: no answer within {within_s:g} s") from None


class ServiceLocator:
    """The address of ``service``: ``fixed`` if given, else a live member in etcd (one picked at
    random, kept until it is avoided or no longer listed)."""

    def __init__(self, service: str, fixed: str = "", etcd_endpoints: str = "", tls: TLSConfig = NO_TLS):
        self.service = service
        self.fixed = fixed
        self.etcd_endpoints = etcd_endpoints
        self.tls = tls
        self._cached = ""
        self._members = 0
        """How many members the last lookup listed."""
        self._lookup: asyncio.Future[list[str]] | None = None
        """The etcd lookup in flight: callers arriving meanwhile share it, so a burst of first
        requests opens one etcd connection, not one each."""

    async def address(self, refresh: bool = False, avoid: str = "") -> str:
        """The member to call. ``refresh``: list the members again, and keep the one used so far
        only if it is still listed and is not ``avoid`` (the one that just failed: its lease may
        outlive it by up to its TTL); else pick another, ``avoid`` only when it is the last."""
        if self.fixed:
            return self.fixed
        if self._cached and not refresh:
            return self._cached
        if self._lookup is None:
            self._lookup = asyncio.ensure_future(self._discover())
            self._lookup.add_done_callback(self._lookup_done)
        # Shielded: one caller cancelled (its client went away) does not cancel the others' lookup.
        members = await asyncio.shield(self._lookup)
        if self._cached not in members or self._cached == avoid:
            self._cached = random.choice([m for m in members if m != avoid] or members)
        return self._cached

    async def on_live_member(self, attempt: Callable[[str], Awaitable[T]]) -> T:
        """``attempt(address)`` on a member; when it raises :class:`MemberUnavailable`, again on
        another live member, as many times as there are members (at least twice: a lone member
        may have been replaced; at most :data:`MEMBER_TRIES`). A fixed address is tried once.
        Raises the last attempt's error, or the lookup's when no member is listed."""
        return await self.on_answering_member(lambda address, _: attempt(address), None)

    async def on_answering_member(
        self, attempt: Callable[[str, float | None], Awaitable[T]], answer_within_s: float | None
    ) -> T:
        """As :meth:`on_live_member`, with ``attempt(address, within_s)``: ``within_s`` is how long
        the attempt waits for the member's first answer before raising
        :class:`MemberUnavailable` (:func:`first_answer`), ``answer_within_s`` on every try but
        the last, None on the last (the call's own deadline bounds it): a hung member costs that
        long, and a member that is only slow still answers when no other does."""
        address = await self.address()
        tries = 1
        while True:
            last = bool(self.fixed) or tries >= min(MEMBER_TRIES, max(2, self._members))
            try:
                return await attempt(address, None if last else answer_within_s)
            except MemberUnavailable:
                if last:
                    raise
            address = await self.address(refresh=True, avoid=address)
            tries += 1

    def _lookup_done(self, lookup: asyncio.Future[list[str]]) -> None:
        self._lookup = None
        if not lookup.cancelled():
            lookup.exception()  # retrieved: every waiter may have gone, and the next call retries

    async def _discover(self) -> list[str]:
        if not self.etcd_endpoints:
            raise Unavailable(f"no {self.service} address configured and no etcd to discover one")
        config = MembershipConfig(etcd_endpoints=self.etcd_endpoints, tls=self.tls)
        for attempt in range(LOOKUP_ATTEMPTS):
            try:
                members = await list_members(config, self.service)
                break
            except Unavailable:
                if attempt == LOOKUP_ATTEMPTS - 1:
                    raise
        if not members:
            raise Unavailable(f"no {self.service} is registered in etcd")
        self._members = len(members)
        return [member.address for member in members]
