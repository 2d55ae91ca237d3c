"""The SDK's exceptions: one class per gRPC status the gateway returns, and the mapping to them.

Every failed call raises a :class:`LoraMeshError` subclass; nothing of grpc leaks to the caller.
A client that cannot be made (no gateway address, no API key) raises :class:`NoGatewayAddress` or
:class:`NoApiKey`, both ``ValueError``.

Example:
    >>> try:
    ...     client.generate("Hi", adapter="missing")
    ... except NotFound as error:
    ...     print(error.code, error.details, error.request_id)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

REQUEST_ID_HEADER = "x-request-id"
RETRY_AFTER_HEADER = "retry-after-s"


class LoraMeshError(Exception):
    """A call to the gateway failed.

    Attributes:
        code: The gRPC status name, e.g. ``"NOT_FOUND"``.
        details: The server's message: it names what is wrong.
        request_id: The ``x-request-id`` of the call; the gateway logs it with every line about
            the call, so quote it when reporting a problem.

    Example:
        >>> try:
        ...     client.models()
        ... except LoraMeshError as error:
        ...     log.warning("loramesh said %s (request %s)", error.code, error.request_id)
    """

    code: str = "UNKNOWN"

    def __init__(self, details: str, *, request_id: str | None = None, code: str | None = None):
        """Creates the error.

        Args:
            details: The server's message.
            request_id: The call's ``x-request-id``.
            code: The status name; only needed for statuses without a subclass of their own.
        """
        super().__init__(details)
        self.details = details
        self.request_id = request_id
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        suffix = f" (request id {self.request_id})" if self.request_id else ""
        return f"{self.code}: {self.details}{suffix}"


class InvalidArgument(LoraMeshError):
    """The request is malformed, or names something that cannot be served.

    For example a bad sampling value, an empty prompt, or an adapter that fails validation.
    """

    code = "INVALID_ARGUMENT"


class NotFound(LoraMeshError):
    """No such adapter, or none the caller may see: another tenant's private adapter is
    answered exactly as a missing one."""

    code = "NOT_FOUND"


class AlreadyExists(LoraMeshError):
    """An adapter of that name is already registered for the caller's tenant."""

    code = "ALREADY_EXISTS"


class PermissionDenied(LoraMeshError):
    """A change to another tenant's adapter (delete, pin), or an import the store's policy
    does not grant."""

    code = "PERMISSION_DENIED"


class Unauthenticated(LoraMeshError):
    """The API key is missing or unknown."""

    code = "UNAUTHENTICATED"


class ResourceExhausted(LoraMeshError):
    """A limit was hit: the tenant's quota (requests in flight, tokens per minute), the mesh is
    at capacity, or an upload is too large.

    When ``retry_after_s`` is set, the server expects a later retry to succeed: the clients
    retry after it (within their ``retries``, when it is at most their ``max_retry_after_s``)
    and raise this once they give up. Without it (an upload too large) nothing is retried.

    Attributes:
        retry_after_s: Seconds after which trying again may work (the ``retry-after-s``
            trailing metadata), or None when the server gave no hint.
    """

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, details: str, *, request_id: str | None = None, retry_after_s: float | None = None):
        """Creates the error.

        Args:
            details: The server's message.
            request_id: The call's ``x-request-id``.
            retry_after_s: The server's hint, in seconds.
        """
        super().__init__(details, request_id=request_id)
        self.retry_after_s = retry_after_s


class Unavailable(LoraMeshError):
    """The gateway cannot be reached, or is starting or draining.

    Raised once the client's ``retries`` are used up (or at once where retrying is unsafe).
    """

    code = "UNAVAILABLE"


class StreamInterrupted(Unavailable):
    """A stream broke after yielding text and was not continued on another gateway: the
    retries (or the call's deadline) ran out first. Nothing was yielded twice."""


class DeadlineExceeded(LoraMeshError):
    """The call's ``timeout`` ran out before it finished."""

    code = "DEADLINE_EXCEEDED"


class FailedPrecondition(LoraMeshError):
    """The mesh is not in a state to do this (e.g. no worker serves the base model)."""

    code = "FAILED_PRECONDITION"


class DataLoss(LoraMeshError):
    """Stored adapter data failed verification."""

    code = "DATA_LOSS"


class InternalError(LoraMeshError):
    """A bug on the server; ``details`` carries the request id to find it in the logs."""

    code = "INTERNAL"


class NoGatewayAddress(ValueError):
    """A client was given no gateway address and found no local mesh to take one from.

    Attributes:
        mesh_file: The mesh file it read (or found absent).
    """

    def __init__(self, message: str, mesh_file: Path):
        """Creates the error.

        Args:
            message: What is missing and what to pass instead.
            mesh_file: The mesh file that was read.
        """
        super().__init__(message)
        self.mesh_file = mesh_file


class NoApiKey(ValueError):
    """A client was given no API key, and the local mesh's admin key does not apply (no mesh
    file, or a gateway that is not one of its own).

    Attributes:
        addresses: The gateways a key was needed for.
    """

    def __init__(self, message: str, addresses: tuple[str, ...]):
        """Creates the error.

        Args:
            message: What is missing and what to pass instead.
            addresses: The gateways a key was needed for.
        """
        super().__init__(message)
        self.addresses = addresses


_BY_CODE: dict[str, type[LoraMeshError]] = {cls.code: cls for cls in LoraMeshError.__subclasses__()}
"""A status name -> its class: every class above declares one status (``StreamInterrupted``, an
``Unavailable``, is not a status of its own), so a class added above is mapped without a list to
keep in step."""


def from_rpc_error(error: grpc.RpcError, request_id: str | None = None) -> LoraMeshError:
    """The SDK exception for a failed gRPC call (sync or asyncio).

    Args:
        error: What grpc raised; its status code picks the class (statuses without a class of
            their own, such as ``CANCELLED``, give a plain :class:`LoraMeshError`).
        request_id: The ``x-request-id`` the call was sent with, used when the server did not
            echo one in its trailing metadata.

    Returns:
        The exception to raise.
    """
    status = error.code()
    code = status.name if status is not None else "UNKNOWN"
    details = error.details() or code
    trailing = {key: value for key, value in (error.trailing_metadata() or ())}
    request_id = trailing.get(REQUEST_ID_HEADER) or request_id
    cls = _BY_CODE.get(code)
    if cls is ResourceExhausted:
        return ResourceExhausted(
            details, request_id=request_id, retry_after_s=_seconds(trailing.get(RETRY_AFTER_HEADER))
        )
    if cls is None:
        return LoraMeshError(details, request_id=request_id, code=code)
    return cls(details, request_id=request_id)


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
