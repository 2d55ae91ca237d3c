"""`loramesh status`: the members in etcd with their health and load, and the local mesh's
processes as its supervisor last wrote them to mesh.json; then the adapter store replicas and
their blob tier (:mod:`loramesh_cli.store_status`) and the workers' DistKV-LLM figures."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from loramesh_cli.distkv_status import DISTKV_KEYS, POLICY_KEYS, distkv_table
from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_file import MeshFile, ServiceEntry, live_mesh
from loramesh_cli.mesh_layout import ETCD_UNIT
from loramesh_cli.store_status import STORE_KEYS, store_table
from loramesh_cli.table import render_table
from loramesh_cli.tls_options import cli_tls
from services.runtime.etcd.membership import MembershipConfig, list_members, read_loads
from services.runtime.process.process import GRPC_SERVICE_NAMES
from services.runtime.rpc.server import check_health
from services.runtime.security.tls import NO_TLS, TLSConfig


def add_status_parser(sub) -> None:
    status = sub.add_parser("status", help="members from etcd with health and load")
    status.add_argument("--etcd", default="", help="etcd endpoint (default: from mesh.json)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)


def _etcd_endpoint(args) -> str:
    if args.etcd:
        return args.etcd
    return live_mesh(Path(args.state_dir), "pass --etcd HOST:PORT").etcd_endpoint


async def collect_status(etcd_endpoint: str, tls: TLSConfig = NO_TLS) -> list[dict]:
    """Every live member with its health (readiness) and latest load report."""
    config = MembershipConfig(etcd_endpoints=etcd_endpoint, tls=tls)
    members = await list_members(config)
    loads = await read_loads(config)
    healths = await asyncio.gather(
        *(check_health(m.address, GRPC_SERVICE_NAMES.get(m.service, ""), tls=tls) for m in members)
    )
    now = time.time()
    rows = []
    for member, health_status in zip(members, healths):
        load = dict(loads.get(member.instance_id, {}))
        load.pop("ts", None)
        rows.append(
            {
                "service": member.service,
                "instance": member.instance_id,
                "address": member.address,
                "health": health_status,
                "uptime_s": round(now - member.started_at, 1),
                "load": load,
            }
        )
    return sorted(rows, key=lambda r: (r["service"], r["instance"]))


def cmd_status(args) -> int:
    try:
        rows = asyncio.run(asyncio.wait_for(collect_status(_etcd_endpoint(args), cli_tls(args)), 15))
    except (TimeoutError, ConnectionError, OSError) as error:
        raise CommandError(f"etcd did not answer: {error or 'timeout'}") from None
    processes = _supervised_processes(args)
    for row in rows:
        if (entry := processes.get(row["instance"])) is not None:
            row["restarts"], row["last_exit"] = entry.restarts, entry.last_exit
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if processes:
        print(_process_table(processes) + "\n")
    if not rows:
        print("no members registered")
        return 0
    print(
        render_table(
            ["SERVICE", "INSTANCE", "ADDRESS", "HEALTH", "UPTIME", "LOAD"],
            [
                [
                    r["service"],
                    r["instance"],
                    r["address"],
                    r["health"],
                    f"{r['uptime_s']:.0f}s",
                    " ".join(
                        f"{k}={len(v) if isinstance(v, list) else v}"
                        for k, v in r["load"].items()
                        if k not in DISTKV_KEYS and k not in POLICY_KEYS and k not in STORE_KEYS
                    ),
                ]
                for r in rows
            ],
        )
    )
    if (stores := store_table(rows)) is not None:
        print("\n" + stores)
    if (distkv := distkv_table(rows)) is not None:
        print("\nDistKV-LLM (blocks per peer; remote attention and bytes per engine step)\n" + distkv)
    return 0


def _supervised_processes(args) -> dict[str, ServiceEntry]:
    """The local mesh's processes by name, etcd included, as its supervisor last wrote them to
    mesh.json; none for a mesh named by ``--etcd``."""
    mesh = None if args.etcd else MeshFile.read(Path(args.state_dir))
    if mesh is None:
        return {}
    return {**({ETCD_UNIT: mesh.etcd} if mesh.etcd else {}), **mesh.services}


def _process_table(processes: dict[str, ServiceEntry]) -> str:
    def last_exit(entry: ServiceEntry) -> str:
        if not entry.last_exit:
            return "-"
        return f"{entry.last_exit} at {time.strftime('%H:%M:%S', time.localtime(entry.last_exit_unix))}"

    return render_table(
        ["PROCESS", "PID", "RESTARTS", "LAST EXIT"],
        [[name, str(e.pid or "-"), str(e.restarts), last_exit(e)] for name, e in processes.items()],
    )
