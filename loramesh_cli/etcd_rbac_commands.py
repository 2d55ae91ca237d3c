"""``loramesh etcd-rbac-sync``: the controller that gives each pod of a Kubernetes mesh its own
etcd user, and takes it away when the pod is gone (``services/runtime/etcd/etcd_rbac_sync.py``)."""

from __future__ import annotations

import asyncio
import os

from loramesh_cli.errors import CommandError
from loramesh_cli.tls_options import cli_tls
from services.runtime.etcd.etcd_rbac_sync import API_SERVER, DEFAULT_INTERVAL_S, EtcdRbacSync, KubernetesPods

ETCD_ENDPOINTS_ENV = "LORAMESH_ETCD_ENDPOINTS"


def add_parsers(sub) -> None:
    sync = sub.add_parser(
        "etcd-rbac-sync",
        help="give each pod of a Kubernetes mesh its own etcd user (run in the cluster)",
        description="Each round lists the mesh's pods (label app.kubernetes.io/part-of=loramesh) with "
        "the pod's service account, gives every pod without one an etcd user and role of its identity "
        "<kind>/<pod name> (it may write only its own member, load and election keys), turns etcd's "
        "auth on, and deletes the users of pods that are gone. Needs the admin certificate "
        '(--tls-ca/--tls-cert/--tls-key): etcd\'s root role (docs/security.md, "etcd").',
    )
    sync.add_argument("--etcd-endpoints", default=os.environ.get(ETCD_ENDPOINTS_ENV, ""),
                      help=f"etcd members, comma-separated, tried in turn (default: ${ETCD_ENDPOINTS_ENV})")  # fmt: skip
    sync.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S,
                      help="seconds between rounds: how long a new pod may wait for its user")  # fmt: skip
    sync.add_argument("--once", action="store_true", help="one round, then exit")
    sync.add_argument("--namespace", default="", help="the pods' namespace (default: this pod's own)")
    sync.add_argument("--api-server", default=API_SERVER, help="the Kubernetes API server")
    sync.set_defaults(func=cmd_etcd_rbac_sync)


def cmd_etcd_rbac_sync(args) -> int:
    endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]
    if not endpoints:
        raise CommandError(f"name etcd: --etcd-endpoints or ${ETCD_ENDPOINTS_ENV}")
    tls = cli_tls(args)
    if not tls.enabled:
        raise CommandError("etcd RBAC needs the admin certificate: --tls-ca, --tls-cert and --tls-key")
    if args.interval_s <= 0:
        raise CommandError(f"--interval-s must be > 0, not {args.interval_s}")
    pods = KubernetesPods(args.api_server, namespace=args.namespace)
    controller = EtcdRbacSync(endpoints, tls, pods)
    if args.once:
        done = asyncio.run(controller.sync_once())
        print(f"added {len(done.added)}, removed {len(done.removed)}")
        return 0
    asyncio.run(controller.run(args.interval_s))
    return 0
