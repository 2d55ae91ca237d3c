"""How a client's calls are made and retried: the gateway each attempt goes to, the credentials
and deadline every attempt carries, and when a failed attempt is tried again. Both clients run
their attempts through these; only the waiting and the I/O are theirs."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from loramesh.errors import (
    REQUEST_ID_HEADER,
    LoraMeshError,
    ResourceExhausted,
    StreamInterrupted,
    Unavailable,
    from_rpc_error,
)
from loramesh.stream_resume import StreamProgress


class GatewayRotation:
    """Which of several gateways a client calls now. Every call starts on the current one; a
    retryable failure there moves the client on to the next (round robin), for every later
    call too, so a dead gateway is left after one failure."""

    def __init__(self, addresses: Sequence[str]):
        self.addresses = tuple(addresses)
        self._index = 0
        self.failovers = 0
        """Attempts that failed with a retryable status and were retried, over the client's life."""

    def current(self) -> str:
        return self.addresses[self._index]

    def failed(self, address: str) -> None:
        """A call to ``address`` failed with a retryable status: move past it (unless another
        call already did)."""
        self.failovers += 1
        if self.addresses[self._index] == address:
            self._index = (self._index + 1) % len(self.addresses)


@dataclass(frozen=True)
class RetryNotice:
    """An attempt failed with ``UNAVAILABLE`` (or ``RESOURCE_EXHAUSTED`` with a retry delay) and is
    about to be retried: what a client's ``on_retry`` is called with (the CLI prints it, so a
    dead gateway is not silent)."""

    failed_address: str
    """The gateway the failed attempt went to."""
    next_address: str
    """The gateway the retry goes to (the next one after ``UNAVAILABLE``, when there are several;
    the same one after ``RESOURCE_EXHAUSTED``)."""
    retry: int
    """This retry's number, from 1."""
    retries: int
    """The most retries the call makes (the client's ``retries``)."""
    delay_s: float
    """Seconds until the retry is sent."""
    failure: LoraMeshError
    """What the failed attempt raised."""


@dataclass(frozen=True)
class CallPolicy:
    """How every call of a client is made: credentials, default timeout, retries."""

    api_key: str
    timeout: float | None
    retries: int
    backoff_s: float
    max_backoff_s: float
    on_retry: Callable[[RetryNotice], None] | None = None
    max_retry_after_s: float = 60.0
    """A ``RESOURCE_EXHAUSTED`` whose retry delay is longer than this is not retried."""

    def start(self, timeout: float | None) -> Call:
        """The bookkeeping of one logical call (all its attempts) with a per-call ``timeout``."""
        budget = self.timeout if timeout is None else timeout
        request_id = uuid.uuid4().hex[:16]
        return Call(
            metadata=(("authorization", f"Bearer {self.api_key}"), (REQUEST_ID_HEADER, request_id)),
            request_id=request_id,
            deadline=None if budget is None else time.monotonic() + budget,
            policy=self,
        )


@dataclass(frozen=True)
class Call:
    """One logical call: its metadata, its deadline across attempts, and when to retry."""

    metadata: tuple[tuple[str, str], ...]
    request_id: str
    deadline: float | None
    policy: CallPolicy

    def remaining(self) -> float | None:
        """Seconds left before the call's deadline (the gRPC timeout of the next attempt)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def failure(self, error: grpc.RpcError) -> LoraMeshError:
        """The SDK exception for an attempt's gRPC error."""
        return from_rpc_error(error, self.request_id)

    def retry_delay(self, attempt: int, failure: LoraMeshError) -> float | None:
        """Seconds to wait before the next attempt, or None when ``failure`` is final.

        Final: retries used up; not UNAVAILABLE, nor RESOURCE_EXHAUSTED with a retry delay of
        at most ``max_retry_after_s`` (a tenant's quota, a full mesh); or the wait would outlast
        the deadline. After UNAVAILABLE the backoff doubles per attempt, with jitter; after
        RESOURCE_EXHAUSTED the wait is the server's delay, never less, plus up to 10% (so that
        clients refused together do not all come back at once).

        Args:
            attempt: The failed attempt's number, from 0.
            failure: What it failed with.
        """
        if attempt >= self.policy.retries:
            return None
        if isinstance(failure, ResourceExhausted):
            if failure.retry_after_s is None or failure.retry_after_s > self.policy.max_retry_after_s:
                return None
            delay = max(failure.retry_after_s, 0.0) * random.uniform(1.0, 1.1)
        elif isinstance(failure, Unavailable):
            delay = min(self.policy.backoff_s * 2**attempt, self.policy.max_backoff_s) * random.uniform(
                0.5, 1.0
            )
        else:
            return None
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        return delay

    def announce_retry(
        self, failed_address: str, next_address: str, attempt: int, delay: float, failure: LoraMeshError
    ) -> None:
        """Tells the client's ``on_retry`` (if any) that attempt ``attempt`` (from 0) is retried."""
        if self.policy.on_retry is not None:
            notice = RetryNotice(
                failed_address, next_address, attempt + 1, self.policy.retries, delay, failure
            )
            self.policy.on_retry(notice)

    def stream_failure(self, failure: LoraMeshError, progress: StreamProgress) -> LoraMeshError:
        """What a stream that is not retried raises: UNAVAILABLE after it yielded text becomes
        :class:`StreamInterrupted` (the caller has part of an answer)."""
        if not progress.delivered or not isinstance(failure, Unavailable):
            return failure
        return StreamInterrupted(
            f"{failure.details}; the stream broke after {len(progress.token_ids)} tokens and was not "
            f"continued (the retries ran out)",
            request_id=failure.request_id,
        )
