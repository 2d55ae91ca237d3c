"""Which instance a call acts for: the caller's own, from its verified certificate.

A worker's lending calls and its requests to the kv_manager name a debtor. Under mutual TLS the
name must be the caller's instance (``gpu_worker/<instance id>``), so no certificate can act as
another worker; over plaintext there is no identity and the request's name is taken as given.
"""

from __future__ import annotations

from services.runtime.errors import InvalidArgument, PermissionDenied
from services.runtime.security.tls import peer_identity_var


def acting_instance(named: str, role: str = "debtor", *, required: bool = True) -> str:
    """The instance this call acts for as ``role``: the caller's under mutual TLS (``named`` may
    be empty or must equal it: PermissionDenied otherwise), ``named`` over plaintext
    (InvalidArgument when empty and ``required``)."""
    caller = peer_identity_var.get()
    if caller is None:
        if not named and required:
            raise InvalidArgument(f"{role} is empty: name the borrowing worker's instance id")
        return named
    if not caller.instance:
        raise PermissionDenied(
            f"the {str(caller)!r} certificate names no instance: a {role} acts with its own "
            "certificate, gpu_worker/<instance id>"
        )
    if named and named != caller.instance:
        raise PermissionDenied(
            f"the {str(caller)!r} certificate may not act for {role} {named!r}: "
            "a worker borrows, reads, frees and asks for creditors only as itself"
        )
    return caller.instance
