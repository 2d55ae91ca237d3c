"""Service membership in etcd: register under a lease, publish load, watch who is alive.

Keys (DESIGN §4)::

    <prefix>/members/<service>/<instance_id>  -> {"address", "http_address", "version", "started_at"}
    <prefix>/load/<instance_id>               -> load report dict + "ts"

Both keys live under one lease (TTL ``ttl_s``, refreshed every TTL/3 by our own loop), so a
member whose process dies disappears within the TTL. A :class:`MemberRegistration` re-registers by
itself (new lease, both keys put again) when etcd comes back after being down, restarted or
wiped, and keeps a :class:`~services.runtime.etcd.lease_fence.LeaseFence`: how long ago its last
answered keepalive was sent, which tells a member cut off from etcd to stop taking new work before
its lease can expire. Every etcd call is bounded by a timeout: a dead etcd never hangs a service.

This module only talks to etcd; it has no gRPC-server code.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import aetcd

from services.runtime.errors import Unavailable
from services.runtime.etcd.lease_fence import LeaseFence
from services.runtime.process.tasks import cancel_and_wait
from services.runtime.security.tls import NO_TLS, TLSConfig, etcd_client

log = logging.getLogger("loramesh.membership")

T = TypeVar("T")

LoadFn = Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]]
"""Returns the load report (a JSON-able dict, sync or async); ``ts`` is added on write."""

FenceCallback = Callable[[str], Awaitable[None]]
"""Told the fence's problem each time the fence goes up (why) or down ("")."""

DEFAULT_TTL_S = 15
"""Default lease TTL. A member refreshes every 5 s and is fenced after 10 s without an answered
keepalive (:mod:`.lease_fence`), so an etcd leader election of ~3 s or a few lost packets on a
real network fence no one; a member that dies is gone from the mesh within 15 s."""

# Channel options for every etcd client: retry a refused connection quickly (etcd restarting),
# notice a dead peer within 15 s on quiet streams too (watches: etcd allows pings every >= 5 s;
# gRPC waits a minute for a ping's answer unless ping_timeout_ms is set, and pings once a minute
# after 2 pings without the client writing unless max_pings_without_data is 0: a cut watch took
# 69 s to notice), and never share a subchannel (and its reconnect backoff) with another client.
# The connect deadline is set per connection from the call timeout (EtcdConnection.client).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.ping_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.use_local_subchannel_pool": 1,
}
_MAX_BACKOFF_S = 1.0


@dataclass(frozen=True)
class MembershipConfig:
    """Where the membership registry lives and how fast it reacts."""

    etcd_endpoints: str = "127.0.0.1:2379"
    """etcd client endpoints, ``host:port``; several may be given comma-separated (tried in turn
    when one fails). An ``http://`` prefix is accepted and ignored."""
    ttl_s: int = DEFAULT_TTL_S
    """Lease TTL in seconds: a member whose process dies is gone at most this long after its
    last refresh. The lease is refreshed every ``ttl_s / 3``; a member whose keepalives have gone
    unanswered for ``2 * ttl_s / 3`` is fenced (:mod:`.lease_fence`)."""
    load_interval_s: float = 1.0
    """Period of the load report write (``<prefix>/load/<instance_id>``)."""
    key_prefix: str = "/loramesh"
    """Root of every key this module reads or writes."""
    call_timeout_s: float = 2.0
    """Upper bound on any single etcd call (also capped at TTL/3 for the refresh loop)."""
    register_timeout_s: float = 20.0
    """How long :meth:`MemberRegistration.start` keeps trying every endpoint (with a short backoff)
    before it gives up: one call can miss ``call_timeout_s`` on a busy machine or while etcd
    elects a leader, and a service should not die of that. 0: one try per endpoint."""
    tls: TLSConfig = NO_TLS
    """Mutual TLS to etcd (its ``--client-cert-auth``); off: plaintext."""

    def __post_init__(self) -> None:
        if not self.endpoints():
            raise ValueError(f"MembershipConfig.etcd_endpoints is empty: {self.etcd_endpoints!r}")
        if self.ttl_s < 1:
            raise ValueError(f"MembershipConfig.ttl_s must be >= 1, got {self.ttl_s}")
        if self.register_timeout_s < 0:
            raise ValueError(
                f"MembershipConfig.register_timeout_s must be >= 0, got {self.register_timeout_s}"
            )
        if self.load_interval_s <= 0:
            raise ValueError(f"MembershipConfig.load_interval_s must be > 0, got {self.load_interval_s}")
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise ValueError(
                f"MembershipConfig.key_prefix must start and not end with '/': {self.key_prefix!r}"
            )

    def endpoints(self) -> list[tuple[str, int]]:
        """The endpoints as ``(host, port)`` pairs, in the order given."""
        out = []
        for raw in self.etcd_endpoints.split(","):
            ep = raw.strip()
            if not ep:
                continue
            for scheme in ("http://", "https://"):
                ep = ep.removeprefix(scheme)
            ep = ep.rstrip("/")
            host, sep, port = ep.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"etcd endpoint must be host:port, got {raw.strip()!r}")
            out.append((host.strip("[]"), int(port)))
        return out


# -- keys --------------------------------------------------------------------------------------


def _check_segment(what: str, value: str) -> None:
    if not value or "/" in value:
        raise ValueError(f"{what} must be non-empty and contain no '/': {value!r}")


def members_prefix(config: MembershipConfig, service: str | None = None) -> str:
    """``<prefix>/members/`` or, for one service, ``<prefix>/members/<service>/``."""
    if service is None:
        return f"{config.key_prefix}/members/"
    _check_segment("service", service)
    return f"{config.key_prefix}/members/{service}/"


def member_key(config: MembershipConfig, service: str, instance_id: str) -> str:
    _check_segment("instance_id", instance_id)
    return members_prefix(config, service) + instance_id


def loads_prefix(config: MembershipConfig) -> str:
    return f"{config.key_prefix}/load/"


def load_key(config: MembershipConfig, instance_id: str) -> str:
    _check_segment("instance_id", instance_id)
    return loads_prefix(config) + instance_id


def new_instance_id(service: str) -> str:
    """A fresh, key-safe instance id such as ``worker-3f9c2a1b``."""
    _check_segment("service", service)
    return f"{service}-{uuid.uuid4().hex[:8]}"


# -- member record -------------------------------------------------------------------------


@dataclass
class MemberInfo:
    """One live service instance, as stored under ``<prefix>/members/<service>/<instance_id>``.

    ``service`` and ``instance_id`` come from the key; the JSON value holds the other fields.
    """

    service: str
    instance_id: str
    address: str
    """gRPC ``host:port``."""
    http_address: str
    """HTTP side port ``host:port`` (``/healthz``, ``/readyz``, ``/metrics``)."""
    version: str
    started_at: float
    """Unix time (seconds) the process started."""

    def __post_init__(self) -> None:
        _check_segment("service", self.service)
        _check_segment("instance_id", self.instance_id)

    @classmethod
    def create(
        cls,
        service: str,
        address: str,
        http_address: str = "",
        version: str = "",
        instance_id: str | None = None,
    ) -> MemberInfo:
        """A record for this process: fresh instance id unless given, ``started_at`` = now."""
        return cls(
            service=service,
            instance_id=instance_id or new_instance_id(service),
            address=address,
            http_address=http_address,
            version=version,
            started_at=time.time(),
        )

    def to_json(self) -> str:
        """The key's value: ``{"address", "http_address", "version", "started_at"}``."""
        return json.dumps(
            {
                "address": self.address,
                "http_address": self.http_address,
                "version": self.version,
                "started_at": self.started_at,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | bytes, *, service: str, instance_id: str) -> MemberInfo:
        """Parse a key's value; ``ValueError`` when it is not the expected JSON object."""
        data = json.loads(raw)
        if not isinstance(data, dict) or "address" not in data:
            raise ValueError(f"member record for {service}/{instance_id} is not a member JSON: {raw!r}")
        return cls(
            service=service,
            instance_id=instance_id,
            address=str(data["address"]),
            http_address=str(data.get("http_address", "")),
            version=str(data.get("version", "")),
            started_at=float(data.get("started_at", 0.0)),
        )

    @classmethod
    def from_kv(cls, config: MembershipConfig, key: str | bytes, value: str | bytes) -> MemberInfo:
        """Parse a full key + value read from etcd."""
        service, instance_id = _split_member_key(config, key)
        return cls.from_json(value, service=service, instance_id=instance_id)


def _split_member_key(config: MembershipConfig, key: str | bytes) -> tuple[str, str]:
    k = key.decode() if isinstance(key, bytes) else key
    root = members_prefix(config)
    if not k.startswith(root):
        raise ValueError(f"not a member key: {k!r}")
    service, sep, instance_id = k[len(root) :].partition("/")
    if not sep or not service or not instance_id or "/" in instance_id:
        raise ValueError(f"not a member key: {k!r}")
    return service, instance_id


# -- connection ------------------------------------------------------------------------------


def channel_options(config: MembershipConfig) -> dict[str, Any]:
    """The gRPC channel options of every etcd client of ``config``."""
    # gRPC's "min reconnect backoff" is its connect deadline (TCP, TLS and the server's first
    # SETTINGS frame). At 100 ms, what it once was, no connection over 50 ms of round trip with
    # TLS, or one losing a packet of its handshake, ever completed.
    return {**_CHANNEL_OPTIONS, "grpc.min_reconnect_backoff_ms": int(config.call_timeout_s * 1000)}


class EtcdConnection:
    """One aetcd client at a time over the configured endpoints; ``reset`` drops it (and moves
    to the next endpoint) so the next call dials afresh."""

    def __init__(self, config: MembershipConfig):
        self.config = config
        self._endpoints = config.endpoints()
        self._index = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    def client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self._endpoints[self._index]
            self._client = etcd_client(
                host,
                port,
                self.config.tls,
                timeout=self.config.call_timeout_s,
                options=channel_options(self.config),
                connect_wait_timeout=max(1, int(self.config.call_timeout_s)),
            )
        return self._client

    async def call(self, fn: Callable[[aetcd.Client], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run ``fn(client)`` bounded by ``timeout_s`` (default ``call_timeout_s``)."""
        timeout = self.config.call_timeout_s if timeout_s is None else timeout_s
        return await asyncio.wait_for(fn(self.client()), timeout)

    async def checked_call(self, fn: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """:meth:`call`; on any failure the client is reset (the next call dials the next endpoint)
        and :class:`EtcdUnreachable` names ``what`` and the cause."""
        try:
            return await self.call(fn)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this caller was cancelled
            # grpc ends the calls of a channel closed under them with CancelledError: another
            # call on this client failed (a watch, when its member died) and reset it. A failure
            # of etcd's connection, not a cancellation: passed on as one, the adapter store's
            # registration ended its RPC with no status, and the caller waited out its whole
            # deadline. The client is already replaced: no second reset.
            raise EtcdUnreachable(
                what, f"etcd at {self.endpoint} unreachable (its client was reset mid-call)"
            ) from None
        except Exception as error:  # noqa: BLE001 - every etcd failure is the same to a caller
            problem = f"etcd at {self.endpoint} unreachable ({describe_etcd_error(error)})"
            await self.reset()
            raise EtcdUnreachable(what, problem) from None

    async def reset(self) -> None:
        """Close the current client (bounded) and rotate to the next endpoint."""
        await self.close()
        self._index = (self._index + 1) % len(self._endpoints)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            await asyncio.wait_for(client.close(), self.config.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - closing a client to a dead etcd: nothing to do
            log.debug("closing etcd client failed: %r", e)


def describe_etcd_error(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class EtcdUnreachable(Unavailable):
    """An etcd call got no answer (:meth:`EtcdConnection.checked_call`)."""

    def __init__(self, what: str, problem: str):
        super().__init__(f"cannot {what}: {problem}")
        self.problem = problem
        """Where and why: ``etcd at HOST:PORT unreachable (cause)``."""


class LeaseLost(Exception):
    """The registration's lease no longer exists in etcd (expired, revoked, or etcd wiped)."""


# -- registration ----------------------------------------------------------------------------


class MemberRegistration:
    """Keeps one member (and its load report) registered in etcd while the process lives.

    ``await start()`` grants a lease, puts both keys under it and starts one background task that
    refreshes the lease every TTL/3 and writes the load report every ``load_interval_s``. When
    etcd fails (down, restarted, wiped, lease expired) the task retries with backoff (<= 1 s) and,
    once etcd answers, registers again under a new lease. ``await stop()`` revokes the lease so
    the member disappears at once (best effort, bounded when etcd is gone).

    ``fence`` times the keepalives on ``clock`` (monotonic seconds; injected in tests); the task
    awaits ``on_fence(problem)`` when the fence goes up or down, within about a second.
    """

    def __init__(
        self,
        config: MembershipConfig,
        member: MemberInfo,
        load_fn: LoadFn | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_fence: FenceCallback | None = None,
    ):
        self.config = config
        self.member = member
        self.load_fn = load_fn
        self.fence = LeaseFence(config.ttl_s, clock)
        """Whether this member may take new work, by its lease keepalives."""
        self._on_fence = on_fence
        self._fenced = False
        self.member_key = member_key(config, member.service, member.instance_id)
        self.load_key = load_key(config, member.instance_id)
        self._conn = EtcdConnection(config)
        self._task: asyncio.Task[None] | None = None
        self._lease_id: int | None = None
        self._lease_ttl: int = config.ttl_s
        self._registered = False
        self._load_error_logged = False
        self.registrations = 0
        """How many times the member was put under a new lease (1 after ``start``)."""

    # -- public state --

    @property
    def registered(self) -> bool:
        """True while the last etcd operation succeeded and the keys are believed present."""
        return self._registered

    @property
    def lease_id(self) -> int | None:
        """The current lease id (None before ``start``)."""
        return self._lease_id

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The refresh/load task (None before ``start`` and after ``stop``)."""
        return self._task

    def __repr__(self) -> str:
        return (
            f"MemberRegistration({self.member.service}/{self.member.instance_id}, "
            f"registered={self._registered}, lease={self._lease_id})"
        )

    # -- lifecycle --

    async def start(self) -> Self:
        """Register now and start keeping the registration alive.

        Every configured endpoint is tried in turn, round after round, until one lets the member
        register or ``register_timeout_s`` has passed. Raises
        :class:`~services.runtime.errors.Unavailable` then, naming each endpoint's last error
        (nothing is left running).
        """
        if self._task is not None:
            raise RuntimeError(f"{self!r} already started")
        deadline = time.monotonic() + self.config.register_timeout_s
        backoff = 0.1
        while (errors := await self._register_once_per_endpoint()) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                await self.stop()  # revokes a lease that a partial attempt may have left behind
                raise Unavailable(
                    f"cannot register {self.member.service}/{self.member.instance_id} in etcd "
                    f"within {self.config.register_timeout_s:g} s ({'; '.join(errors)})"
                )
            await asyncio.sleep(min(backoff, left))
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
        log.info(
            "registered %s at %s (lease %x, ttl %ss)",
            self.member_key,
            self.member.address,
            self._lease_id,
            self._lease_ttl,
        )
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"membership:{self.member.service}/{self.member.instance_id}"
        )
        return self

    async def _register_once_per_endpoint(self) -> list[str] | None:
        """Try each endpoint once; None when registered, else each endpoint's error."""
        errors: list[str] = []
        for _ in self.config.endpoints():
            try:
                await self._register(self.config.call_timeout_s)
                return None
            except asyncio.CancelledError:
                await self._conn.close()
                raise
            except Exception as e:  # noqa: BLE001 - reported in start()'s Unavailable
                errors.append(f"{self._conn.endpoint}: {describe_etcd_error(e)}")
                self._registered = False
                await self._conn.reset()
        return errors

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop refreshing, revoke the lease (the member disappears at once) and close the client.

        Never hangs: each step is bounded (``timeout_s``, default ``call_timeout_s``); if etcd is
        unreachable the keys simply expire after the TTL.
        """
        await self._cancel_task()
        lease_id = self._lease_id
        self._registered = False
        if lease_id is not None:
            try:
                await self._conn.call(lambda c: c.revoke_lease(lease_id), timeout_s)
                log.info("deregistered %s (lease %x revoked)", self.member_key, lease_id)
            except asyncio.CancelledError:
                await self._conn.close()
                raise
            except Exception as e:  # noqa: BLE001 - best effort: the lease expires anyway
                log.warning(
                    "could not revoke lease %x of %s (%s); it expires within %ss",
                    lease_id,
                    self.member_key,
                    describe_etcd_error(e),
                    self._lease_ttl,
                )
        self._lease_id = None
        await self._conn.close()

    async def abandon(self) -> None:
        """Stop refreshing and close the client *without* revoking: the member stays until its
        lease expires, as if the process had crashed."""
        await self._cancel_task()
        self._registered = False
        await self._conn.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])

    # -- etcd operations --

    def _refresh_interval(self) -> float:
        return max(0.2, self._lease_ttl / 3.0)

    def _op_timeout(self) -> float:
        # A refresh that takes longer than TTL/3 is as good as failed: retry instead.
        return min(self.config.call_timeout_s, self._refresh_interval())

    async def _register(self, timeout: float) -> None:
        """Grant a new lease and put the member and load keys under it."""
        sent_at = self.fence.clock()
        lease = await self._conn.call(lambda c: c.lease(self.config.ttl_s), timeout)
        lease_id, granted = int(lease.id), int(lease.ttl or self.config.ttl_s)
        member_value = self.member.to_json().encode()
        await self._conn.call(
            lambda c: c.put(self.member_key.encode(), member_value, lease=lease_id), timeout
        )
        old = self._lease_id
        self._lease_id, self._lease_ttl = lease_id, granted
        self._registered = True
        self.registrations += 1
        self.fence.renewed(sent_at, granted)
        await self._write_load()
        if old is not None and old != lease_id:
            # The keys moved to the new lease; drop the old one if it still exists.
            with contextlib.suppress(Exception):
                await self._conn.call(lambda c: c.revoke_lease(old), timeout)

    async def _refresh(self) -> None:
        lease_id = self._lease_id
        assert lease_id is not None
        sent_at = self.fence.clock()
        reply = await self._conn.call(lambda c: c.refresh_lease(lease_id), self._op_timeout())
        ttl = getattr(reply, "TTL", None)
        if ttl is None or ttl <= 0:
            self.fence.lost(f"lease {lease_id:x} not found in etcd")
            raise LeaseLost(f"lease {lease_id:x} not found (TTL {ttl})")
        self.fence.renewed(sent_at, self._lease_ttl)

    async def _load_report(self) -> dict[str, Any] | None:
        if self.load_fn is None:
            return {"ts": time.time()}
        try:
            result = self.load_fn()
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, self.config.load_interval_s)
            report = dict(result or {})
        except asyncio.CancelledError:
            raise
        except Exception:  # a broken load_fn must not drop the registration
            if not self._load_error_logged:
                log.exception("load_fn of %s failed; load report skipped", self.member_key)
                self._load_error_logged = True
            return None
        self._load_error_logged = False
        report["ts"] = time.time()
        return report

    async def _write_load(self) -> None:
        report = await self._load_report()
        if report is None:
            return
        try:
            value = json.dumps(report).encode()
        except (TypeError, ValueError) as e:
            if not self._load_error_logged:
                log.error("load report of %s is not JSON-serialisable: %s", self.member_key, e)
                self._load_error_logged = True
            return
        lease_id = self._lease_id
        await self._conn.call(
            lambda c: c.put(self.load_key.encode(), value, lease=lease_id), self._op_timeout()
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.1
        next_refresh = loop.time() + self._refresh_interval()
        next_load = loop.time() + self.config.load_interval_s
        failing_since: float | None = None
        while True:
            await self._notice_fence()
            try:
                if not self._registered:
                    old = self._lease_id
                    await self._register(self._op_timeout())
                    await self._notice_fence()
                    log.info(
                        "re-registered %s after %.1fs (lease %s -> %x)",
                        self.member_key,
                        loop.time() - (failing_since or loop.time()),
                        f"{old:x}" if old is not None else "none",
                        self._lease_id,
                    )
                    failing_since = None
                    backoff = 0.1
                    now = loop.time()
                    next_refresh = now + self._refresh_interval()
                    next_load = now + self.config.load_interval_s
                now = loop.time()
                if now >= next_refresh:
                    await self._refresh()
                    next_refresh = now + self._refresh_interval()
                if now >= next_load:
                    await self._write_load()
                    next_load = now + self.config.load_interval_s
                await asyncio.sleep(max(0.0, min(next_refresh, next_load) - loop.time()))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure: retry, never let the loop die
                if failing_since is None:
                    failing_since = loop.time()
                    log.warning(
                        "membership of %s in etcd at %s failed (%s); re-registering",
                        self.member_key,
                        self._conn.endpoint,
                        describe_etcd_error(e),
                    )
                else:
                    log.debug("etcd still failing for %s: %s", self.member_key, describe_etcd_error(e))
                self.fence.failed(f"etcd at {self._conn.endpoint}: {describe_etcd_error(e)}")
                self._registered = False
                await self._conn.reset()
                await asyncio.sleep(backoff)
                backoff = min(_MAX_BACKOFF_S, backoff * 2)

    async def _notice_fence(self) -> None:
        """Log the fence going up or down and tell ``on_fence`` (a failing callback is logged)."""
        problem = self.fence.problem()
        if bool(problem) == self._fenced:
            return
        self._fenced = bool(problem)
        if problem:
            log.warning("%s takes no new work: %s", self.member_key, problem)
        else:
            log.info("%s takes new work again: its etcd lease is kept alive", self.member_key)
        if self._on_fence is not None:
            try:
                await self._on_fence(problem)
            except Exception:  # the registration must outlive a broken callback
                log.exception("fence callback of %s failed", self.member_key)


# -- reading ---------------------------------------------------------------------------------


def _parse_members(config: MembershipConfig, kvs: Any) -> dict[str, MemberInfo]:
    out: dict[str, MemberInfo] = {}
    for kv in kvs:
        try:
            m = MemberInfo.from_kv(config, kv.key, kv.value)
        except (ValueError, TypeError) as e:
            log.warning("ignoring malformed member key %r: %s", kv.key, e)
            continue
        out[m.instance_id] = m
    return out


def _parse_loads(config: MembershipConfig, kvs: Any) -> dict[str, dict[str, Any]]:
    root = loads_prefix(config)
    out: dict[str, dict[str, Any]] = {}
    for kv in kvs:
        key = kv.key.decode() if isinstance(kv.key, bytes) else kv.key
        instance_id = key[len(root) :]
        try:
            data = json.loads(kv.value)
        except ValueError as e:
            log.warning("ignoring malformed load key %r: %s", key, e)
            continue
        if isinstance(data, dict) and instance_id:
            out[instance_id] = data
    return out


async def _get_prefix_once(config: MembershipConfig, prefix: str) -> Any:
    conn = EtcdConnection(config)
    errors = []
    try:
        for _ in config.endpoints():
            try:
                return await conn.call(lambda c: c.get_prefix(prefix.encode()))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reported in the Unavailable below
                errors.append(f"{conn.endpoint}: {describe_etcd_error(e)}")
                await conn.reset()
        raise Unavailable(f"etcd unreachable ({'; '.join(errors)})")
    finally:
        await conn.close()


async def list_members(config: MembershipConfig, service: str | None = None) -> list[MemberInfo]:
    """The members registered now (one read), sorted by service then instance id.

    Raises :class:`~services.runtime.errors.Unavailable` when etcd cannot be reached.
    """
    resp = await _get_prefix_once(config, members_prefix(config, service))
    members = _parse_members(config, resp)
    return sorted(members.values(), key=lambda m: (m.service, m.instance_id))


async def read_loads(config: MembershipConfig) -> dict[str, dict[str, Any]]:
    """The current load reports (one read): ``{instance_id: report}``; each report has ``ts``.

    Raises :class:`~services.runtime.errors.Unavailable` when etcd cannot be reached.
    """
    resp = await _get_prefix_once(config, loads_prefix(config))
    return _parse_loads(config, resp)


async def _watch_prefix_map(
    config: MembershipConfig,
    prefix: str,
    parse: Callable[[MembershipConfig, Any], dict[str, T]],
    what: str,
) -> AsyncIterator[dict[str, T]]:
    """Yield the parsed contents of ``prefix`` each time they change: list, then watch from the
    next revision; on any failure reconnect (backoff <= 1 s) and list again."""
    conn = EtcdConnection(config)
    last: dict[str, T] | None = None
    backoff = 0.1
    failing = False
    try:
        while True:
            watch = None
            try:
                resp = await conn.call(lambda c: c.get_prefix(prefix.encode()))
                current = parse(config, resp)
                revision = resp.header.revision
                if failing:
                    log.info("%s watch on %s reconnected", what, conn.endpoint)
                    failing = False
                backoff = 0.1
                if current != last:
                    last = dict(current)
                    yield dict(current)
                watch = await conn.call(
                    lambda c, start=revision + 1: c.watch_prefix(prefix.encode(), start_revision=start)
                )
                async for event in watch:
                    changed = False
                    kv = event.kv
                    if event.kind == aetcd.EventKind.PUT:
                        parsed = parse(config, [kv])
                        for k, v in parsed.items():
                            if current.get(k) != v:
                                current[k] = v
                                changed = True
                    else:
                        for k in _deleted_ids(config, prefix, kv.key):
                            if current.pop(k, None) is not None:
                                changed = True
                    if changed and current != last:
                        last = dict(current)
                        yield dict(current)
                # The stream ended without an error (client closed under us): start over.
                raise ConnectionError("watch stream ended")
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:  # noqa: BLE001 - any failure: reconnect and list again
                if not failing:
                    log.warning(
                        "%s watch on %s failed (%s); reconnecting",
                        what,
                        conn.endpoint,
                        describe_etcd_error(e),
                    )
                    failing = True
                else:
                    log.debug("%s watch still failing: %s", what, describe_etcd_error(e))
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(watch.cancel(), config.call_timeout_s)
                await conn.reset()
                await asyncio.sleep(backoff)
                backoff = min(_MAX_BACKOFF_S, backoff * 2)
    finally:
        await asyncio.shield(conn.close())


def _deleted_ids(config: MembershipConfig, prefix: str, key: bytes | str) -> list[str]:
    """The map keys a deleted etcd key stood for (instance id for members and loads)."""
    k = key.decode() if isinstance(key, bytes) else key
    if not k.startswith(prefix):
        return []
    if prefix.startswith(members_prefix(config)):
        try:
            return [_split_member_key(config, k)[1]]
        except ValueError:
            return []
    return [k[len(prefix) :]]


def watch_members(
    config: MembershipConfig, service: str | None = None
) -> AsyncIterator[dict[str, MemberInfo]]:
    """Async generator of the live member set ``{instance_id: MemberInfo}`` (of one service, or
    all when ``service`` is None), yielded first as listed and then every time it changes.

    Survives etcd restarts: it reconnects and lists again (yielding only if the set differs).
    While etcd is unreachable nothing is yielded; the last set stands. Close it with
    ``aclose()`` (or ``contextlib.aclosing``) or by cancelling the task iterating it.
    """
    return _watch_prefix_map(config, members_prefix(config, service), _parse_members, "members")


def watch_loads(config: MembershipConfig) -> AsyncIterator[dict[str, dict[str, Any]]]:
    """Like :func:`watch_members` for the load reports: ``{instance_id: report}`` per change."""
    return _watch_prefix_map(config, loads_prefix(config), _parse_loads, "loads")


async def follow(
    updates: AsyncIterator[T], apply: Callable[[T], None], listed: asyncio.Event | None = None
) -> None:
    """Apply every update of a watch (:func:`watch_members`, :func:`watch_loads`) until cancelled;
    ``listed`` is set after the first one. A failing ``apply`` is logged and the watch goes on."""
    try:
        async for update in updates:
            try:
                apply(update)
            except Exception:  # a bad report must not stop the watch
                log.exception("could not apply an etcd update")
            if listed is not None:
                listed.set()
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def listed_within(
    config: MembershipConfig, timeout_s: float, what: str, *listed: Awaitable[object]
) -> None:
    """Wait until every one of ``listed`` is done (the :class:`asyncio.Event` waits of
    :func:`follow`'s first updates, an election decided): how a service that follows etcd starts.
    :class:`~services.runtime.errors.Unavailable` naming ``what`` etcd did not list within
    ``timeout_s``."""
    try:
        await asyncio.wait_for(asyncio.gather(*listed), timeout_s)
    except TimeoutError:
        raise Unavailable(
            f"etcd at {config.etcd_endpoints} did not list {what} within {timeout_s:.1f}s"
        ) from None


__all__ = [
    "DEFAULT_TTL_S",
    "EtcdUnreachable",
    "FenceCallback",
    "LeaseLost",
    "LoadFn",
    "MemberInfo",
    "MemberRegistration",
    "MembershipConfig",
    "follow",
    "list_members",
    "listed_within",
    "load_key",
    "loads_prefix",
    "member_key",
    "members_prefix",
    "new_instance_id",
    "read_loads",
    "watch_loads",
    "watch_members",
]
