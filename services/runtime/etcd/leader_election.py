"""One active replica among several: leader election on an etcd key.

The leader holds ``<prefix>/leader/<service>`` (value: its instance id) under a lease of its
own, refreshed every TTL/3. Every candidate runs the same round every TTL/3: refresh its lease,
then put-if-absent on the key in one transaction (``version == 0`` -> put, else read the
holder). So a leader that stops cleanly (lease revoked) is replaced within one round, one that
dies within its TTL plus one round, and any etcd failure makes a candidate step down at once
(a replica that cannot reach etcd cannot know it still leads).

The leader's **term** is the key's create revision when it took it: etcd gives every key
creation a larger revision than any before, so a later leader's term is larger, and a term stays
the same while the same key lives (rounds that refresh or move its lease keep it). A leader
stamps its writes with its term (the fencing token, issue 49); the writes it makes to the key
compare that revision. Before a write it may :meth:`LeaderElection.confirm` the key is still its
own at that term, and a leader told by a target that a newer term exists :meth:`steps down
<LeaderElection.step_down>`: it revokes its lease, so a re-win is a new, larger term.

This module only talks to etcd; it has no gRPC-server code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.runtime.etcd.membership import EtcdConnection, MembershipConfig, describe_etcd_error
from services.runtime.process.tasks import cancel_and_wait

log = logging.getLogger("loramesh.leader")


def leader_key(config: MembershipConfig, service: str) -> str:
    """``<prefix>/leader/<service>``."""
    if not service or "/" in service:
        raise ValueError(f"service must be non-empty and contain no '/': {service!r}")
    return f"{config.key_prefix}/leader/{service}"


class LeaderElection:
    """This instance's candidacy for leading ``service``; ``leader_id`` is who leads now."""

    def __init__(
        self,
        config: MembershipConfig,
        service: str,
        instance_id: str,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        """``sleep``: the wait between two rounds (a test holds rounds back with its own)."""
        self.config = config
        self.service = service
        self.instance_id = instance_id
        self.key = leader_key(config, service)
        self.leader_id = ""
        """Instance id of the leader as of the last round; empty while unknown (etcd failing)."""
        self.leader_term = 0
        """The leader's term (the key's create revision) as of the last round; 0 while unknown."""
        self.terms = 0
        """How many times this instance became the leader."""
        self._sleep = sleep
        self._conn = EtcdConnection(config)
        self._lease_id: int | None = None
        self._resigning = False
        self._decided = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def is_leader(self) -> bool:
        return self.leader_id == self.instance_id

    @property
    def term(self) -> int:
        """This instance's term while it leads (the fencing token its writes carry), else 0."""
        return self.leader_term if self.is_leader else 0

    def _interval(self) -> float:
        return max(0.2, self.config.ttl_s / 3.0)

    async def start(self) -> None:
        """Start campaigning (in the background)."""
        if self._task is not None:
            raise RuntimeError(f"election of {self.instance_id} for {self.key} already started")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"leader-election:{self.service}/{self.instance_id}"
        )

    async def wait_decided(self) -> None:
        """Return once a round has told who leads (this instance or another)."""
        await self._decided.wait()

    async def stop(self) -> None:
        """Stop campaigning and revoke the lease: if this instance led, the key goes at once
        (bounded; when etcd is gone the key expires after the TTL)."""
        await self._cancel_task()
        lease_id, self._lease_id = self._lease_id, None
        self._set_leader("")
        if lease_id is not None:
            try:
                await self._conn.call(lambda c: c.revoke_lease(lease_id))
            except Exception as e:  # noqa: BLE001 - the lease expires by itself
                log.warning("could not revoke the %s election lease: %s", self.key, describe_etcd_error(e))
        await self._conn.close()

    async def abandon(self) -> None:
        """Stop campaigning *without* revoking: a key this instance holds stays until its lease
        expires, as if the process had crashed."""
        await self._cancel_task()
        self._lease_id = None
        self._set_leader("")
        await self._conn.close()

    def step_down(self, term: int, why: str) -> None:
        """Stop leading at once if this instance leads under ``term`` (a target refused a write
        of that term: a newer leader exists). The next round revokes its lease, so a key still
        its own goes, and campaigns again: leading again takes a new, larger term."""
        if term == 0 or term != self.term:
            return  # an older tenure's write: this one is not deposed by it
        log.warning("%s steps down as leader of %s (term %d): %s", self.instance_id, self.service, term, why)
        self._resigning = True
        self._set_leader("")

    async def confirm(self) -> int:
        """This instance's term if etcd (a linearizable read) still shows the key as its own at
        that term; else 0, having stepped down (an etcd failure too: it cannot know it leads)."""
        term = self.term
        if not term:
            return 0
        key = self.key.encode()
        try:
            holder = await self._conn.call(
                lambda c: c.get(key), min(self.config.call_timeout_s, self._interval())
            )
        except Exception as e:  # noqa: BLE001 - whatever failed, leadership is not confirmed
            self.step_down(term, f"could not confirm the key {self.key}: {describe_etcd_error(e)}")
            return 0
        if holder is None or holder.value != self.instance_id.encode() or holder.create_revision != term:
            now = "gone" if holder is None else f"{holder.value.decode()!r} at term {holder.create_revision}"
            self.step_down(term, f"the key {self.key} is {now}")
            return 0
        return term

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])

    def _set_leader(self, leader_id: str, term: int = 0) -> None:
        if (leader_id, term) == (self.leader_id, self.leader_term):
            return
        was_leader = self.is_leader
        self.leader_id, self.leader_term = leader_id, term
        if self.is_leader:
            self.terms += 1
            log.info("%s is now the leader of %s (term %d)", self.instance_id, self.service, term)
        elif was_leader:
            log.warning(
                "%s is no longer the leader of %s (now %r)", self.instance_id, self.service, leader_id
            )
        else:
            log.info("the leader of %s is %r (term %d)", self.service, leader_id, term)

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                leader_id, term = await self._round()
                if self._resigning:  # stepped down while the round ran: the next one revokes
                    leader_id, term = "", 0
                self._set_leader(leader_id, term)
                self._decided.set()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure: step down and try again
                if not failing:
                    log.warning(
                        "leader election on %s failed (%s); stepping down", self.key, describe_etcd_error(e)
                    )
                    failing = True
                self._set_leader("")
                self._lease_id = None  # a live old lease expires by itself
                await self._conn.reset()
            await self._sleep(self._interval())

    async def _round(self) -> tuple[str, int]:
        """Keep our lease alive and try to take the key; returns the leader's instance id and
        term ("" and 0 when the key is free and not taken)."""
        timeout = min(self.config.call_timeout_s, self._interval())
        if self._resigning and self._lease_id is not None:
            lease_id, self._lease_id = self._lease_id, None
            try:
                await self._conn.call(lambda c: c.revoke_lease(lease_id), timeout)
            except Exception as e:  # noqa: BLE001 - gone already, or it expires by itself
                log.warning("could not revoke the %s election lease: %s", self.key, describe_etcd_error(e))
        self._resigning = False
        if self._lease_id is not None:
            lease_id = self._lease_id
            reply = await self._conn.call(lambda c: c.refresh_lease(lease_id), timeout)
            if getattr(reply, "TTL", 0) <= 0:
                log.warning("election lease %x of %s expired", lease_id, self.instance_id)
                self._lease_id = None
        if self._lease_id is None:
            lease = await self._conn.call(lambda c: c.lease(self.config.ttl_s), timeout)
            self._lease_id = int(lease.id)
        key, me, lease_id = self.key.encode(), self.instance_id.encode(), self._lease_id

        def take_if_free(c):
            return c.transaction(
                compare=[c.transactions.version(key) == 0],
                success=[c.transactions.put(key, me, lease=lease_id), c.transactions.get(key)],
                failure=[c.transactions.get(key)],
            )

        taken, responses = await self._conn.call(take_if_free, timeout)
        if taken:
            return self.instance_id, responses[1][0][1].create_revision
        holder = responses[0][0][1] if responses and responses[0] else None
        if holder is None:
            return "", 0
        term = holder.create_revision
        if holder.value == me and holder.lease != lease_id:
            # Ours under an older lease (a refresh failed while that lease lived on): move the
            # key to the current lease if it is still the one we hold. The term stays: a put to
            # a live key keeps its create revision.
            def keep_if_mine(c):
                return c.transaction(
                    compare=[c.transactions.create(key) == term, c.transactions.value(key) == me],
                    success=[c.transactions.put(key, me, lease=lease_id)],
                    failure=[],
                )

            kept, _ = await self._conn.call(keep_if_mine, timeout)
            return (self.instance_id, term) if kept else ("", 0)
        return holder.value.decode(), term
