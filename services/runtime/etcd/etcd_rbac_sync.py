"""etcd's per-instance users kept in step with the pods that run the mesh (Kubernetes).

``loramesh up --tls`` knows every instance before it starts them and provisions their etcd users
once (:mod:`services.runtime.etcd.etcd_rbac`). In Kubernetes a pod's name, and so its identity
``<kind>/<pod name>`` (cert-manager's csi-driver writes it into the pod's certificate), exists
only once the pod is created. :class:`EtcdRbacSync` closes that gap as a small controller: each
round it lists the mesh's pods and

- gives every pod that has no etcd user yet its user and role (the same grants as ``up --tls``:
  read the mesh, write only its own member, load and election keys), and turns etcd's auth on at
  the first round;
- deletes the user and role of every instance whose pod is gone, so a later pod given the same
  name starts from a fresh grant and nothing is left for a stolen certificate of a dead pod.

A pod that starts before its round finds no etcd user, fails to register and is restarted by its
Deployment, as any pod that starts before etcd is ready (docs/deploy.md, "Start order").
The pods come from :class:`KubernetesPods`, the API server's pod list read with the controller's
service account (a Role that may only list pods in its namespace).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from services.runtime.etcd.etcd_rbac import CALL_TIMEOUT_S, MESH_KEYS, provision_etcd_rbac
from services.runtime.etcd.membership import MembershipConfig
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.tls import TLSConfig, aio_channel

log = logging.getLogger("loramesh.etcd_rbac_sync")

KIND_OF_APP = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "adapter-store": "adapter_store",
    "gpu-worker": "gpu_worker",
    "kv-manager": "kv_manager",
}
"""A pod's ``app.kubernetes.io/name`` label (k8s/base) -> the kind its certificate names."""
APP_LABEL = "app.kubernetes.io/name"
MESH_SELECTOR = "app.kubernetes.io/part-of=loramesh"
"""The label every object of the mesh carries (k8s/base/kustomization.yaml)."""
GONE_PHASES = ("Succeeded", "Failed")
"""Pods in these phases run nothing: their users go. A terminating pod keeps its user until its
object is deleted, so that it can still take its own keys out of etcd on the way down."""
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_SERVER = "https://kubernetes.default.svc"
DEFAULT_INTERVAL_S = 5.0
"""Seconds between rounds: how long a new pod may wait for its etcd user."""

PodList = dict
"""The API server's ``PodList`` (JSON)."""


def identities_of_pods(pods: PodList) -> set[MeshIdentity]:
    """The identity of every live pod of a mesh kind in ``pods``: ``<kind>/<pod name>``."""
    identities = set()
    for pod in pods.get("items", ()):
        metadata = pod.get("metadata", {})
        kind = KIND_OF_APP.get((metadata.get("labels") or {}).get(APP_LABEL, ""))
        if kind is None or pod.get("status", {}).get("phase") in GONE_PHASES:
            continue
        identities.add(MeshIdentity(kind, metadata["name"]))
    return identities


async def instance_users(endpoint: str, root_tls: TLSConfig) -> set[MeshIdentity]:
    """The per-instance users etcd has (``<kind>/<instance>``; root and ``admin`` left out)."""
    async with aio_channel(endpoint, root_tls) as channel:
        listed = await rpc_pb2_grpc.AuthStub(channel).UserList(
            rpc_pb2.AuthUserListRequest(), timeout=CALL_TIMEOUT_S
        )
    users = set()
    for name in listed.users:
        if "/" in name:
            users.add(MeshIdentity.parse(name))
    return users


async def remove_etcd_users(endpoint: str, root_tls: TLSConfig, identities: Iterable[MeshIdentity]) -> None:
    """Delete the users and roles of ``identities`` (one already gone is skipped)."""
    async with aio_channel(endpoint, root_tls) as channel:
        auth = rpc_pb2_grpc.AuthStub(channel)
        for identity in identities:
            for method, request in (
                (auth.UserDelete, rpc_pb2.AuthUserDeleteRequest(name=str(identity))),
                (auth.RoleDelete, rpc_pb2.AuthRoleDeleteRequest(role=str(identity))),
            ):
                try:
                    await method(request, timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as error:
                    if "not found" not in (error.details() or ""):
                        raise


@dataclass(frozen=True)
class SyncRound:
    """What one round changed."""

    added: frozenset[MeshIdentity]
    removed: frozenset[MeshIdentity]


class EtcdRbacSync:
    """Gives each pod of the mesh its etcd user, and takes it away when the pod is gone."""

    def __init__(
        self,
        endpoints: list[str],
        root_tls: TLSConfig,
        list_pods: Callable[[], Awaitable[PodList]],
        config: MembershipConfig = MESH_KEYS,
    ):
        """``endpoints``: the etcd members, tried in turn (a round that fails moves to the next);
        ``root_tls``: the etcd root's ``admin`` certificate; ``list_pods``: the
        mesh's pods now (:class:`KubernetesPods`; tests pass their own)."""
        if not endpoints:
            raise ValueError("name at least one etcd endpoint")
        self._endpoints = list(endpoints)
        self._tls = root_tls
        self._list_pods = list_pods
        self._config = config
        self._auth_on = False

    async def sync_once(self) -> SyncRound:
        """One round: list the pods, add the missing users, delete those of gone pods."""
        wanted = identities_of_pods(await self._list_pods())
        endpoint = self._endpoints[0]
        try:
            have = await instance_users(endpoint, self._tls) if self._auth_on else set()
            added, removed = wanted - have, have - wanted
            if added or not self._auth_on:
                await provision_etcd_rbac(endpoint, self._tls, sorted(added, key=str), self._config)
                self._auth_on = True
            if removed:
                await remove_etcd_users(endpoint, self._tls, sorted(removed, key=str))
        except (OSError, grpc.aio.AioRpcError):
            self._endpoints.append(self._endpoints.pop(0))  # the next member next round
            raise
        for identity in sorted(added, key=str):
            log.info("etcd user %s added", identity)
        for identity in sorted(removed, key=str):
            log.info("etcd user %s removed: its pod is gone", identity)
        return SyncRound(frozenset(added), frozenset(removed))

    async def run(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        """Rounds every ``interval_s`` until cancelled; a failed round is logged and retried."""
        while True:
            try:
                await self.sync_once()
            except (OSError, grpc.aio.AioRpcError, ValueError) as error:
                log.warning("etcd RBAC round failed, retrying in %.0f s: %s", interval_s, error)
            await asyncio.sleep(interval_s)


class KubernetesPods:
    """The mesh's pods in one namespace, from the API server, as the pod's service account."""

    def __init__(
        self, api_server: str = API_SERVER, account_dir: Path = SERVICE_ACCOUNT_DIR, namespace: str = ""
    ):
        """``namespace``: empty reads the pod's own (the service account's ``namespace`` file)."""
        self._api_server = api_server.rstrip("/")
        self._account_dir = account_dir
        self._namespace = namespace or (account_dir / "namespace").read_text().strip()

    def _get(self) -> PodList:
        query = urllib.parse.urlencode({"labelSelector": MESH_SELECTOR})
        url = f"{self._api_server}/api/v1/namespaces/{urllib.parse.quote(self._namespace)}/pods?{query}"
        # The token is read per call: Kubernetes rotates projected service-account tokens.
        token = (self._account_dir / "token").read_text().strip()
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        context = None
        if url.startswith("https:"):
            context = ssl.create_default_context(cafile=str(self._account_dir / "ca.crt"))
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S, context=context) as response:
            return json.loads(response.read())

    async def __call__(self) -> PodList:
        return await asyncio.to_thread(self._get)
