"""Who may call what: one table, (service, method) -> the callers allowed, and why.

Every server installs it through the shared interceptor (services.runtime.rpc.interceptors) when it
runs with TLS. On an internal port (mutual TLS) the caller is the identity its verified certificate
names (services.runtime.security.identity). The gateway's public port asks for no client certificate:
every caller there is a :data:`TENANT`, whom the gateway then authenticates by API key
(services.gateway.auth), and a certificate presented there (a mesh service's, the operator's) is not
even read. Deny by default: a method missing from the table is refused to every caller, and a caller
outside the method's row is refused, both with ``PERMISSION_DENIED`` and one line naming the caller,
the method and who may call it.

With TLS off there is no verified identity and the table is not enforced: every caller is served,
as before. docs/security.md prints the table as the mesh's threat model (a test keeps the two
equal, and another that every method of every service in the protos has a row).

Rows grant kinds, not instances. What must not be shared between two instances of a kind is bound
to the instance where it is served: a worker's borrowed KV blocks (the lending RPCs' debtor is
the caller's instance, services.gpu_worker.servicer) and its etcd keys (services.runtime.etcd.etcd_rbac).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.runtime.errors import PermissionDenied
from services.runtime.security.identity import KINDS, MeshIdentity

TENANT = "tenant"
"""Not a certificate's kind: any caller of the gateway's public port, which asks for no client
certificate. The gateway's servicer then authenticates it by its API key, which names the tenant."""

CALLERS = (*KINDS, TENANT)
"""Everything a row may grant: the certificates' kinds and :data:`TENANT`."""


@dataclass(frozen=True)
class Rule:
    """One row: who may call a method, and why they need to."""

    callers: frozenset[str]
    """Callers allowed: identity kinds (services.runtime.security.identity.KINDS) or :data:`TENANT`."""
    why: str
    """Why those callers, and only those: the threat model's sentence for the row."""


def _rule(callers: str, why: str) -> Rule:
    return Rule(frozenset(callers.split()), why)


_STORE = "loramesh.v1.AdapterStore"
_GATEWAY = "loramesh.v1.Gateway"
_SCHEDULER = "loramesh.v1.Scheduler"
_KV_MANAGER = "loramesh.v1.KVManager"
_WORKER = "loramesh.v1.Worker"
_HEALTH = "grpc.health.v1.Health"
_REFLECTION = "grpc.reflection.v1alpha.ServerReflection"

_OWNER = "it acts for the adapter's owner named in the request: only the gateway (which maps a tenant's API key to that owner) and the operator"
_TENANT_API = "the public API, on the gateway's public port: callers present no certificate; the gateway authenticates each call by its API key, which names the tenant, and acts only for that tenant"
_LENDING = "DistKV-LLM: a debtor worker and its creditor; the debtor is the caller's own instance (its certificate), never a name in the request"
_PREFIX_TIER = "the cluster prefix tier: a worker announces its cached prefix blocks, as its own instance (its certificate), and fetches another's by chain key"
_DGFM = "DGFM: the kv_manager leader has a worker bring its lent blocks home"

TABLE: Mapping[tuple[str, str], Rule] = {
    (_STORE, "RegisterAdapter"): _rule("gateway operator", _OWNER),
    (_STORE, "ImportAdapter"): _rule("gateway operator", _OWNER),
    (_STORE, "DeleteAdapter"): _rule("gateway operator", _OWNER),
    (_STORE, "GetAdapter"): _rule("gateway operator", "an adapter's metadata: the gateway resolves a tenant's names and checks access"),
    (_STORE, "ListAdapters"): _rule("gateway operator", "listings are per owner: the gateway asks for a tenant's own"),
    (_STORE, "WatchAdapters"): _rule("gateway operator", "each gateway keeps an index of the catalog, which /v1/models lists per tenant"),
    (_STORE, "FetchAdapter"): _rule("gpu_worker", "the weights of any tenant's adapter: only a worker pulls them, to serve them"),
    (_STORE, "SetAdapterPinned"): _rule("gateway operator", _OWNER),
    (_STORE, "ListPinnedAdapters"): _rule("gpu_worker operator", "a worker keeps the pinned adapters it holds resident"),
    (_STORE, "Stats"): _rule("operator", "operator's view of the store"),
    (_GATEWAY, "Generate"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "Chat"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "UploadAdapter"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "ImportAdapter"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "ListAdapters"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "GetAdapter"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "DeleteAdapter"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "ListModels"): _rule("tenant", _TENANT_API),
    (_GATEWAY, "SetAdapterPinned"): _rule("tenant", _TENANT_API),
    (_SCHEDULER, "Place"): _rule("gateway", "the gateway places each request it relays"),
    (_SCHEDULER, "ReportCompletion"): _rule("gateway", "the gateway reports how long a request really was (length predictor)"),
    (_SCHEDULER, "ClusterView"): _rule("operator", "operator's view of the workers and the policies"),
    (_SCHEDULER, "Migrate"): _rule("operator", "an operator moves a request by hand; the scheduler's own migrations call the workers directly"),
    (_KV_MANAGER, "SuggestCreditors"): _rule("gpu_worker", "a debtor worker asks whom to borrow KV blocks from, as its own instance (its certificate)"),
    (_KV_MANAGER, "ReportRefusal"): _rule("gpu_worker", "a debtor worker reports a creditor that refused it, as its own instance (its certificate)"),
    (_KV_MANAGER, "Ledger"): _rule("operator", "operator's view of the debt ledger"),
    (_KV_MANAGER, "PlanDefragmentation"): _rule("operator", "operator's dry run of DGFM"),
    (_KV_MANAGER, "Defragment"): _rule("operator", "an operator runs DGFM now (it moves blocks between workers)"),
    (_KV_MANAGER, "AnnouncePrefixBlocks"): _rule("gpu_worker", _PREFIX_TIER),
    (_KV_MANAGER, "LocatePrefix"): _rule("gpu_worker", _PREFIX_TIER),
    (_WORKER, "Generate"): _rule("gateway", "the gateway relays a placed request; the prompt and the output are a tenant's"),
    (_WORKER, "LoadAdapter"): _rule("scheduler", "the scheduler pages an adapter in before it places there"),
    (_WORKER, "Prefetch"): _rule("scheduler", "the scheduler's prefetch policy"),
    (_WORKER, "Stats"): _rule("operator", "operator's view of one worker"),
    (_WORKER, "ListRequests"): _rule("scheduler operator", "the scheduler's migration and prefetch policies read the queue"),
    (_WORKER, "HandOff"): _rule("scheduler", "the scheduler's migrations end a stream here to resume it elsewhere"),
    (_WORKER, "AllocateBlocks"): _rule("gpu_worker", _LENDING),
    (_WORKER, "WriteKv"): _rule("gpu_worker", _LENDING),
    (_WORKER, "FreeBlocks"): _rule("gpu_worker", _LENDING),
    (_WORKER, "AttendRemote"): _rule("gpu_worker", _LENDING),
    (_WORKER, "ReadBlocks"): _rule("gpu_worker", _LENDING),
    (_WORKER, "OpenLendingLane"): _rule("gpu_worker", _LENDING),
    (_WORKER, "RecallBlocks"): _rule("kv_manager", _DGFM),
    (_WORKER, "StageOutBlocks"): _rule("kv_manager", _DGFM),
    (_WORKER, "StageInBlocks"): _rule("kv_manager", _DGFM),
    (_WORKER, "FetchPrefixBlocks"): _rule("gpu_worker", _PREFIX_TIER),
    (_HEALTH, "Check"): _rule("gateway scheduler adapter_store gpu_worker kv_manager operator tenant", "liveness and readiness: `loramesh status`, `loramesh up` waiting for each service as itself, and anyone at the gateway's public port"),
    (_HEALTH, "List"): _rule("operator", "every status at once: an operator's view"),
    (_HEALTH, "Watch"): _rule("gateway scheduler adapter_store gpu_worker kv_manager operator tenant", "as Check, streamed"),
    (_REFLECTION, "ServerReflectionInfo"): _rule("operator", "an operator's grpcurl; the schema is no secret but nobody else needs it"),
}  # fmt: skip
"""Every RPC any loramesh server serves, by ``(full service name, method)``."""


def _split_method(path: str) -> tuple[str, str]:
    """``/loramesh.v1.Worker/Generate`` -> ``("loramesh.v1.Worker", "Generate")``."""
    service, _, method = path.lstrip("/").rpartition("/")
    return service, method


def authorize(path: str, identity: MeshIdentity | None, *, public: bool = False) -> None:
    """Raise :class:`PermissionDenied` unless the caller may call the RPC at ``path``
    (``/<service>/<method>``). Only called with TLS on. ``public``: the call came to the gateway's
    public port, whose callers are all :data:`TENANT` (it reads no certificate); else ``identity``
    is what the caller's verified certificate names (None: it names no mesh identity)."""
    service, method = _split_method(path)
    rule = TABLE.get((service, method))
    if rule is None:
        raise PermissionDenied(
            f"{service}/{method} is in no row of the authorization table: nobody may call it"
        )
    if public:
        if TENANT not in rule.callers:
            raise PermissionDenied(
                f"{service}/{method} is not for tenants: only {_names(rule)} may call it ({rule.why}), "
                "presenting its certificate to an internal port; the gateway's public port reads no "
                "certificate, only API keys"
            )
        return
    if identity is None:
        raise PermissionDenied(
            f"the caller's certificate names no mesh identity (spiffe://loramesh/<kind>[/<instance>]): "
            f"{service}/{method} is refused"
        )
    if identity.kind not in KINDS:
        raise PermissionDenied(
            f"the caller's certificate names {str(identity)!r}, which is no kind the mesh issues "
            f"({', '.join(KINDS)}): {service}/{method} is refused"
        )
    if identity.kind not in rule.callers:
        raise PermissionDenied(
            f"the {str(identity)!r} identity may not call {service}/{method}: "
            f"only {_names(rule)} may ({rule.why})"
        )


def _names(rule: Rule) -> str:
    return ", ".join(sorted(rule.callers))
