"""``loramesh up``, ``down`` and ``status``: a local mesh on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from loramesh.cli.errors import CommandError
from loramesh.cli.mesh_file import MeshFile, ServiceEntry, pid_alive
from loramesh.cli.table import render_table
from services.runtime.etcd_server import EtcdServer, free_port
from services.runtime.membership import MembershipConfig, list_members, read_loads
from services.runtime.private_files import private_dir
from services.runtime.process import GRPC_SERVICE_NAMES, ServiceProcess
from services.runtime.server import check_health

#: Tenant of the local admin key that `loramesh up` writes to mesh.json.
ADMIN_TENANT = "admin"


def add_parsers(sub) -> None:
    up = sub.add_parser("up", help="start etcd and every service on loopback (foreground)")
    up.add_argument(
        "--model", default="", help="base model: GGUF file or HF directory (default SmolLM2-135M)"
    )
    up.add_argument("--workers", type=int, default=1, help="gpu_worker processes (default 1)")
    up.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                    help="worker compute dtype")  # fmt: skip
    up.add_argument("--pool-mib", type=int, default=512, help="each worker's unified pool")
    up.add_argument(
        "--api-keys-file", default="", help="JSON {api key: tenant} for the gateway, besides the admin key"
    )
    up.add_argument("--detach", action="store_true", help="run in the background; return once ready")
    up.add_argument("--ram-budget-mib", type=int, default=1024, help="adapter store RAM tier")
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the local mesh started by `loramesh up`")
    down.set_defaults(func=cmd_down)
    status = sub.add_parser("status", help="members from etcd with health and load")
    status.add_argument("--etcd", default="", help="etcd endpoint (default: from mesh.json)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_not_running(state_dir: Path) -> None:
    mesh = MeshFile.read(state_dir)
    if mesh is not None and pid_alive(mesh.up_pid):
        raise CommandError(f"a mesh is already up (pid {mesh.up_pid}); run `loramesh down` first")
    MeshFile.remove(state_dir)


def cmd_up(args) -> int:
    state_dir = Path(args.state_dir)
    _check_not_running(state_dir)
    if args.detach:
        return _up_detached(args, state_dir)
    return asyncio.run(_up_foreground(args, state_dir))


def _up_detached(args, state_dir: Path) -> int:
    # The state directory holds the admin key, etcd's data and the tenants' adapters: owner only.
    log_dir = private_dir(private_dir(state_dir) / "logs")
    argv = [sys.executable, "-m", "loramesh.cli.main", "--state-dir", str(state_dir), "up"]
    if args.model:
        argv += ["--model", args.model]
    argv += ["--ram-budget-mib", str(args.ram_budget_mib), "--workers", str(args.workers)]
    argv += ["--dtype", args.dtype, "--pool-mib", str(args.pool_mib)]
    if args.api_keys_file:
        argv += ["--api-keys-file", str(Path(args.api_keys_file).resolve())]
    with open(log_dir / "up.log", "ab") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        mesh = MeshFile.read(state_dir)
        if mesh is not None and mesh.up_pid == child.pid and mesh.ready:
            _print_summary(mesh, state_dir)
            return 0
        if child.poll() is not None:
            tail = (log_dir / "up.log").read_text(errors="replace").splitlines()[-20:]
            raise CommandError("the mesh failed to start:\n" + "\n".join(tail))
        time.sleep(0.2)
    child.terminate()
    raise CommandError("the mesh did not become ready within 180 s; see .loramesh/logs/")


def _print_summary(mesh: MeshFile, state_dir: Path) -> None:
    _log(f"mesh up (pid {mesh.up_pid}); etcd {mesh.etcd_endpoint}")
    for name, entry in mesh.services.items():
        _log(f"  {name:<14} grpc {entry.address}  http {entry.http_address}  log {entry.log}")
        if entry.openai_address:
            _log(f"  {'':<14} OpenAI API http://{entry.openai_address}/v1")
    _log(f"state in {MeshFile.path(state_dir)}; stop with `loramesh down`")


async def _up_foreground(args, state_dir: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The state directory holds the admin key, etcd's data and the tenants' adapters: owner only.
    log_dir = private_dir(private_dir(state_dir) / "logs")
    etcd = EtcdServer(data_dir=state_dir / "etcd")
    etcd.start()
    processes: dict[str, ServiceProcess] = {}
    try:
        store_args = ["--etcd-endpoints", etcd.endpoint, "--data-dir", str(state_dir / "adapter_store"),
                      "--ram-budget-mib", str(args.ram_budget_mib)]  # fmt: skip
        if args.model:
            store_args += ["--model", args.model]
        processes["adapter_store"] = ServiceProcess(
            "adapter_store", store_args, log_path=log_dir / "adapter_store.log"
        ).start()
        await processes["adapter_store"].wait_ready()
        # Workers sharing one machine's cores split them rather than oversubscribe (CPU serving).
        threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
        worker_args = ["--etcd-endpoints", etcd.endpoint, "--adapter-store", processes["adapter_store"].address,
                       "--dtype", args.dtype, "--pool-mib", str(args.pool_mib), "--threads", str(threads)]  # fmt: skip
        if args.model:
            worker_args += ["--model", args.model]
        for i in range(args.workers):
            processes[f"gpu_worker-{i}"] = ServiceProcess(
                "gpu_worker",
                [*worker_args, "--instance-id", f"gpu_worker-{i}"],
                log_path=log_dir / f"gpu_worker-{i}.log",
            ).start()
        processes["scheduler"] = ServiceProcess(
            "scheduler", ["--etcd-endpoints", etcd.endpoint], log_path=log_dir / "scheduler.log"
        ).start()
        # DistKV-LLM's gManager: the workers' KV-block debt ledger, fed by their heartbeats in etcd.
        processes["kv_manager"] = ServiceProcess(
            "kv_manager", ["--etcd-endpoints", etcd.endpoint], log_path=log_dir / "kv_manager.log"
        ).start()
        admin_api_key = "lm-admin-" + secrets.token_urlsafe(18)
        gateway_args = ["--etcd-endpoints", etcd.endpoint, "--adapter-store", processes["adapter_store"].address,
                        "--scheduler", processes["scheduler"].address]  # fmt: skip
        if args.model:
            gateway_args += ["--model", args.model]
        if args.api_keys_file:
            gateway_args += ["--api-keys-file", args.api_keys_file]
        openai_address = f"127.0.0.1:{free_port()}"
        gateway_args += ["--openai-port", openai_address.rsplit(":", 1)[1]]
        # The key goes by environment, not argv, so it does not show in `ps`.
        processes["gateway"] = ServiceProcess(
            "gateway", gateway_args, log_path=log_dir / "gateway.log",
            env={"LORAMESH_API_KEYS": f"{admin_api_key}={ADMIN_TENANT}"},
        ).start()  # fmt: skip
        await asyncio.gather(*(p.wait_ready(300) for p in processes.values()))
        mesh = MeshFile(
            up_pid=os.getpid(),
            etcd_endpoint=etcd.endpoint,
            etcd_pid=etcd.pid or 0,
            admin_api_key=admin_api_key,
            services={
                name: ServiceEntry(
                    p.address,
                    p.http_address,
                    p.pid or 0,
                    str(p.log_path),
                    openai_address=openai_address if name == "gateway" else "",
                )
                for name, p in processes.items()
            },
            ready=True,
        )
        mesh.write(state_dir)
        _print_summary(mesh, state_dir)
        await stop.wait()
        _log("stopping the mesh")
    finally:
        for proc in processes.values():
            await asyncio.to_thread(proc.terminate)
        etcd.stop()
        MeshFile.remove(state_dir)
    return 0


def cmd_down(args) -> int:
    state_dir = Path(args.state_dir)
    mesh = MeshFile.read(state_dir)
    if mesh is None or not pid_alive(mesh.up_pid):
        MeshFile.remove(state_dir)
        raise CommandError("no mesh is up (no live `loramesh up` in .loramesh/mesh.json)")
    os.kill(mesh.up_pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while pid_alive(mesh.up_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in [e.pid for e in mesh.services.values()] + [mesh.etcd_pid, mesh.up_pid]:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    MeshFile.remove(state_dir)
    _log("mesh stopped")
    return 0


def _etcd_endpoint(args) -> str:
    if args.etcd:
        return args.etcd
    mesh = MeshFile.read(Path(args.state_dir))
    if mesh is None:
        raise CommandError("no mesh is up; start one with `loramesh up` or pass --etcd HOST:PORT")
    return mesh.etcd_endpoint


async def collect_status(etcd_endpoint: str) -> list[dict]:
    """Every live member with its health (readiness) and latest load report."""
    config = MembershipConfig(etcd_endpoints=etcd_endpoint)
    members = await list_members(config)
    loads = await read_loads(config)
    healths = await asyncio.gather(
        *(check_health(m.address, GRPC_SERVICE_NAMES.get(m.service, "")) for m in members)
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
        rows = asyncio.run(asyncio.wait_for(collect_status(_etcd_endpoint(args)), 15))
    except (TimeoutError, ConnectionError, OSError) as error:
        raise CommandError(f"etcd did not answer: {error or 'timeout'}") from None
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
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
                    " ".join(f"{k}={len(v) if isinstance(v, list) else v}" for k, v in r["load"].items()),
                ]
                for r in rows
            ],
        )
    )
    return 0
