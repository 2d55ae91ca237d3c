"""Domain errors. Domain code raises these; one interceptor maps them to gRPC status codes.

Domain modules never import grpc: they raise a subclass of :class:`DomainError` with a message
that names what is wrong, and ``services.runtime.rpc.interceptors`` turns it into a status.
"""

from __future__ import annotations


class DomainError(Exception):
    """Base of every error a service reports to its caller on purpose."""

    code_name: str = "UNKNOWN"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(DomainError):
    """The request itself is malformed or refers to something that cannot be served."""

    code_name = "INVALID_ARGUMENT"


class NotFound(DomainError):
    code_name = "NOT_FOUND"


class AlreadyExists(DomainError):
    code_name = "ALREADY_EXISTS"


class PermissionDenied(DomainError):
    code_name = "PERMISSION_DENIED"


class Unauthenticated(DomainError):
    code_name = "UNAUTHENTICATED"


class ResourceExhausted(DomainError):
    """A limit was hit: size, quota, queue. ``retry_after_s`` hints when trying again may work."""

    code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FailedPrecondition(DomainError):
    code_name = "FAILED_PRECONDITION"


class StaleLeaderTerm(FailedPrecondition):
    """A leader's write refused as fenced: its term is older than the newest one the callee has
    taken writes under, so a newer leader exists and the writer must step down. Travels as
    ``FAILED_PRECONDITION`` with ``current_term`` in trailing metadata, so the caller can tell it
    from another failed precondition."""

    def __init__(self, message: str, current_term: int):
        super().__init__(message)
        self.current_term = current_term


class Unavailable(DomainError):
    """The service cannot take this right now (draining, dependency down); retrying may work."""

    code_name = "UNAVAILABLE"


class DeadlineExceeded(DomainError):
    """The request's deadline or SLO can no longer be met (e.g. an early abort)."""

    code_name = "DEADLINE_EXCEEDED"


class DataLoss(DomainError):
    """Stored data failed verification (checksum mismatch, missing blob)."""

    code_name = "DATA_LOSS"
