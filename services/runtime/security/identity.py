"""Who a mesh peer is: its kind of service and, in a per-instance certificate, which instance.

A mesh certificate names its identity twice, as the URI SAN ``spiffe://loramesh/<kind>`` or
``spiffe://loramesh/<kind>/<instance>`` and as ``CN=<kind>`` or ``CN=<kind>/<instance>`` (etcd
maps the CN to its user: services.runtime.etcd.etcd_rbac). The authorization table
(services.runtime.security.authorization) grants by kind; what must not be shared between instances, a
worker's borrowed KV blocks or its etcd keys, is bound to the instance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Every kind of identity the mesh's certificates name. ``operator`` is the operator's CLI (a client
#: only): the operator RPCs of the internal ports, and a read-only etcd user. ``admin`` is etcd's
#: root user alone (it creates the other etcd users: ``loramesh up --tls``, ``etcd-rbac-sync``),
#: which no gRPC method accepts. ``etcd`` is the etcd server's own certificate. Tenants hold no
#: certificate: they call the gateway's public port, which asks for none, with their API key.
KINDS = ("gateway", "scheduler", "adapter_store", "gpu_worker", "kv_manager", "etcd", "admin", "operator")

SPIFFE_PREFIX = "spiffe://loramesh/"

_INSTANCE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,252}")
"""An instance id: a key segment of etcd, a pod name, a file name (no ``/``, not ``.``/``..``)."""


@dataclass(frozen=True)
class MeshIdentity:
    """One identity: ``gpu_worker`` (any worker, as ``loramesh certs`` issues by default) or
    ``gpu_worker/gpu_worker-0`` (that instance only)."""

    kind: str
    """Which service (one of :data:`KINDS` for the identities the mesh issues)."""
    instance: str = ""
    """The instance id the certificate is bound to (its ``--instance-id``, in Kubernetes the pod
    name); empty: a certificate shared by every instance of the kind."""

    def __post_init__(self) -> None:
        if not self.kind or "/" in self.kind:
            raise ValueError(f"an identity's kind must be non-empty and contain no '/': {self.kind!r}")
        if self.instance and not _INSTANCE.fullmatch(self.instance):
            raise ValueError(
                f"instance id {self.instance!r} of {self.kind} must be letters, digits, '.', '_' or '-'"
            )

    @classmethod
    def parse(cls, text: str) -> MeshIdentity:
        """``<kind>`` or ``<kind>/<instance>``; ``ValueError`` for anything else."""
        kind, slash, instance = text.partition("/")
        if slash and not instance:
            raise ValueError(f"identity {text!r} ends with '/': name the instance, or drop the '/'")
        return cls(kind, instance)

    @property
    def spiffe_id(self) -> str:
        """The URI SAN naming it: ``spiffe://loramesh/<kind>[/<instance>]``."""
        return SPIFFE_PREFIX + str(self)

    def __str__(self) -> str:
        return f"{self.kind}/{self.instance}" if self.instance else self.kind
