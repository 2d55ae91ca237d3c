"""Who may say whose an adapter is.

``RegisterAdapter`` takes its ``owner`` from the request and ``DeleteAdapter`` acts on an owner's
adapter, so the store trusts the caller to have authenticated that owner. Only two callers do:
the gateway (it maps a tenant's API key to the owner) and the operator's ``loramesh adapters``
(the ``admin`` identity). With mutual TLS on, the caller's identity is the one in its verified
certificate, and any other identity (a worker, the scheduler) is refused. Over plaintext there is
no identity to check (None) and the store behaves as before: turn mTLS on to enforce the rule.
"""

from __future__ import annotations

from services.runtime.errors import PermissionDenied

OWNER_SETTERS = frozenset({"gateway", "admin"})
"""Identities whose ``owner`` the store accepts."""


def check_owner_setter(identity: str | None, action: str) -> None:
    """Raise :class:`PermissionDenied` unless ``identity`` may ``action`` (e.g. "register an
    adapter") for an owner it names; ``None`` (plaintext, no certificate) passes."""
    if identity is None or identity in OWNER_SETTERS:
        return
    raise PermissionDenied(
        f"the {identity!r} identity may not {action}: only {' and '.join(sorted(OWNER_SETTERS))} "
        "certificates may act for an adapter's owner"
    )
