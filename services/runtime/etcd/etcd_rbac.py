"""etcd's own authorization for the mesh: one etcd user per instance identity, each allowed to
write only its own keys (``loramesh up --tls``).

etcd runs with ``--client-cert-auth``; once its auth is on, it takes the CN of a client's
verified certificate as the user, with no password. :func:`provision_etcd_rbac` gives each
instance identity ``<kind>/<instance>`` (services.runtime.security.identity) a user and a role of that
name, which may

- read every key under ``<prefix>/`` (members find each other, read load reports, watch);
- write its member key ``<prefix>/members/<kind>/<instance>``, its load key
  ``<prefix>/load/<instance>`` and, for a kind that elects a leader, that election's key.

So no certificate can register as another instance, rewrite another's load report, or revoke
another's lease (etcd revokes a lease only for a user that may write every key on it). The
``operator`` identity (the operator's CLI: ``loramesh status``) may read the mesh's keys and write
none. Only the ``admin`` identity has the root role, which creates these users (``loramesh up
--tls``, ``etcd-rbac-sync``); so has the user ``root``, which etcd needs before it turns auth on
(its password is random and thrown away: nobody logs in with a password). Any other certificate of
the mesh CA, a kind's shared one (``gpu_worker``) or the etcd server's own, has no user and etcd
refuses its requests.

Idempotent: run again against an etcd whose auth is on already (``up`` restarted on the same
state directory), it adds what is missing, as ``admin``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import grpc
from aetcd.rpc import auth_pb2, rpc_pb2, rpc_pb2_grpc

from services.runtime.etcd.leader_election import leader_key
from services.runtime.etcd.membership import MembershipConfig, load_key, member_key
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.tls import TLSConfig, aio_channel

ROOT_ROLE = "root"
ROOT_USER = "root"
ETCD_ROOT = MeshIdentity("admin")
"""The identity with etcd's root role: what creates etcd's users, and nothing else (no gRPC
method accepts it)."""
OPERATOR = MeshIdentity("operator")
"""The operator's CLI: reads every key of the mesh (``loramesh status``), writes none."""

LEADER_ELECTIONS: dict[str, tuple[str, ...]] = {
    "scheduler": ("scheduler-rebalancer",),
    "kv_manager": ("kv_manager",),
}
"""The elections each kind campaigns in (``<prefix>/leader/<election>``); a test keeps these
equal to the services' own names."""

WRITABLE_PREFIXES: dict[str, tuple[str, ...]] = {
    "adapter_store": ("adapter_store/",),
    "gateway": ("gateway/",),
}
"""Key ranges under ``<prefix>/`` each kind writes as a whole: the adapter catalog, which every
store replica shares; the tenants' generation slots, which every gateway shares
(services/gateway/shared_quota.py)."""

MESH_KEYS = MembershipConfig()
"""Where the services keep their keys (the default ``key_prefix``, as every service runs)."""

CALL_TIMEOUT_S = 10.0
"""Bound on each etcd auth call."""


def readable_range(config: MembershipConfig) -> tuple[bytes, bytes]:
    """``[key, range_end)`` of every key the mesh keeps: ``<prefix>/`` and below."""
    return f"{config.key_prefix}/".encode(), f"{config.key_prefix}0".encode()


def writable_ranges(config: MembershipConfig, identity: MeshIdentity) -> list[tuple[bytes, bytes]]:
    """``[key, range_end)`` of the key ranges ``identity``'s kind writes (:data:`WRITABLE_PREFIXES`)."""
    ranges = []
    for prefix in WRITABLE_PREFIXES.get(identity.kind, ()):
        start = f"{config.key_prefix}/{prefix}".encode()
        ranges.append((start, start[:-1] + bytes([start[-1] + 1])))
    return ranges


def writable_keys(config: MembershipConfig, identity: MeshIdentity) -> list[str]:
    """The keys ``identity`` (an instance) may write: its member and load keys, its elections."""
    if not identity.instance:
        raise ValueError(f"{identity} names no instance: etcd users are per instance")
    keys = [member_key(config, identity.kind, identity.instance), load_key(config, identity.instance)]
    return keys + [leader_key(config, election) for election in LEADER_ELECTIONS.get(identity.kind, ())]


async def provision_etcd_rbac(
    endpoint: str,
    root_tls: TLSConfig,
    identities: Iterable[MeshIdentity],
    config: MembershipConfig = MESH_KEYS,
) -> None:
    """Create the users and roles of ``identities`` (each with an instance), of the etcd root
    (:data:`ETCD_ROOT`) and of the operator (:data:`OPERATOR`, read only) in the etcd at
    ``endpoint``, then turn its auth on. ``root_tls``: the :data:`ETCD_ROOT` certificate (root
    once auth is on). ``config``: where the mesh's keys are (its prefix)."""
    read_from, read_to = readable_range(config)
    read = auth_pb2.Permission(permType=auth_pb2.Permission.READ, key=read_from, range_end=read_to)
    async with aio_channel(endpoint, root_tls) as channel:
        auth = rpc_pb2_grpc.AuthStub(channel)

        async def call(method, request) -> None:
            try:
                await method(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                if "already exists" not in (error.details() or ""):
                    raise

        async def user(name: str, role: str) -> None:
            await call(
                auth.UserAdd, rpc_pb2.AuthUserAddRequest(name=name, password=secrets.token_urlsafe(24))
            )
            await call(auth.UserGrantRole, rpc_pb2.AuthUserGrantRoleRequest(user=name, role=role))

        async def role(name: str, grants: list[auth_pb2.Permission]) -> None:
            await call(auth.RoleAdd, rpc_pb2.AuthRoleAddRequest(name=name))
            for grant in grants:
                await call(
                    auth.RoleGrantPermission, rpc_pb2.AuthRoleGrantPermissionRequest(name=name, perm=grant)
                )

        for name in (ROOT_USER, str(ETCD_ROOT)):
            await user(name, ROOT_ROLE)
        await role(str(OPERATOR), [read])
        await user(str(OPERATOR), str(OPERATOR))
        for identity in identities:
            name = str(identity)
            grants = [read]
            grants += [
                auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=key.encode())
                for key in writable_keys(config, identity)
            ]
            grants += [
                auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=start, range_end=end)
                for start, end in writable_ranges(config, identity)
            ]
            await role(name, grants)
            await user(name, name)
        await call(auth.AuthEnable, rpc_pb2.AuthEnableRequest())
