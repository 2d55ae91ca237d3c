"""``loramesh up`` and ``down``: a local mesh on loopback, supervised (its command line:
:mod:`loramesh_cli.up_arguments`; its processes: :mod:`loramesh_cli.mesh_layout`; ``status``:
:mod:`loramesh_cli.mesh_status`)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loramesh.tls import ClientTLS
from loramesh_cli.errors import CommandError
from loramesh_cli.gateway_keys_copy import GatewayKeysCopy
from loramesh_cli.lora_modules import register_lora_modules
from loramesh_cli.mesh_file import MeshFile, ServiceEntry, command_line, pid_alive, why_not_live
from loramesh_cli.mesh_layout import ETCD_UNIT, STORE_KIND, check_service_settings, service_processes
from loramesh_cli.mesh_status import add_status_parser
from loramesh_cli.prometheus_targets import write_prometheus_targets
from loramesh_cli.supervisor import EtcdUnit, ServiceUnit, Supervisor, describe_exit
from loramesh_cli.up_arguments import (
    ADMIN_TENANT,
    add_up_parser,
    admin_key,
    check_up_args,
    detached_argv,
    lora_modules,
    plain_keys_by_tenant,
    restart_policy,
)
from loramesh_cli.worker_formats import read_worker_formats
from services.runtime.errors import InvalidArgument
from services.runtime.etcd.etcd_rbac import ETCD_ROOT, OPERATOR, provision_etcd_rbac
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.process.process import ServiceProcess, ServiceStartError
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.private_files import private_dir
from services.runtime.security.tls import NO_TLS

#: The certificates of a `--tls` mesh beside each service's own: etcd's server, etcd's root (`up`
#: creates etcd's users with it) and the operator's (the CLI's, for the internal ports and etcd).
#: Tenants, the SDK and the CLI's gateway commands hold none: the CA alone, and an API key.
MESH_IDENTITIES = ("etcd", ETCD_ROOT, OPERATOR)

#: How long `up` waits for every service to be ready: a guard against a hang, large because
#: nine processes loading on a busy 2-core machine take minutes.
READY_TIMEOUT_S = 300


def add_parsers(sub) -> None:
    add_up_parser(sub).set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the local mesh started by `loramesh up`")
    down.set_defaults(func=cmd_down)
    add_status_parser(sub)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_not_running(state_dir: Path) -> None:
    mesh = MeshFile.read(state_dir)
    if why_not_live(state_dir, mesh) is None:
        raise CommandError(
            f"a mesh is already up (pid {mesh.up_pid}, {MeshFile.path(state_dir).absolute()}); "
            f"run `{command_line(state_dir, 'down')}` first"
        )
    MeshFile.remove(state_dir)


def cmd_up(args) -> int:
    check_up_args(args)
    check_service_settings(args, os.environ)
    state_dir = Path(args.state_dir)
    _check_not_running(state_dir)
    if args.detach:
        return _up_detached(args, state_dir)
    return asyncio.run(_up_foreground(args, state_dir))


def _up_detached(args, state_dir: Path) -> int:
    # The state directory holds the admin key, etcd's data and the tenants' adapters: owner only.
    log_dir = private_dir(private_dir(state_dir) / "logs")
    log_path = (log_dir / "up.log").absolute()
    argv = detached_argv(args, state_dir)
    with open(log_path, "ab") as out:
        start = out.tell()
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S + 60
    while time.monotonic() < deadline:
        mesh = MeshFile.read(state_dir)
        if mesh is not None and mesh.up_pid == child.pid and mesh.ready:
            print_summary(mesh, state_dir)
            return 0
        if child.poll() is not None:
            raise CommandError(
                f"the mesh failed to start: {_failure_reason(log_path, start)} (log {log_path})"
            )
        time.sleep(0.2)
    child.terminate()
    raise CommandError(
        f"the mesh did not become ready within {READY_TIMEOUT_S + 60} s; see {log_dir.absolute()}"
    )


def _failure_reason(log_path: Path, start: int) -> str:
    """Why the background `up` exited: its own refusal (the last ``loramesh: `` line it wrote
    since ``start``), else its last line."""
    with open(log_path, "rb") as log:
        log.seek(start)
        lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    refusals = [line.removeprefix("loramesh: ") for line in lines if line.startswith("loramesh: ")]
    return refusals[-1] if refusals else (lines[-1] if lines else "it exited without a word")


def print_summary(mesh: MeshFile, state_dir: Path) -> None:
    """What `up` prints once the mesh is ready: every process's addresses, who is authorized
    (:func:`authorization_summary`), then where its state is and how to stop it (with the
    ``--state-dir`` it was started with)."""
    _log(f"mesh up (pid {mesh.up_pid}); etcd {mesh.etcd_endpoint}")
    # With --tls the side ports and the OpenAI port speak HTTPS only (the mesh CA's certificates).
    tls = mesh.tls_config().enabled
    scheme = "https" if tls else "http"
    for name, entry in mesh.services.items():
        _log(f"  {name:<15} grpc {entry.address}  {scheme} {entry.http_address}  log {entry.log}")
        if entry.openai_address:
            _log(f"  {'':<15} OpenAI API {scheme}://{entry.openai_address}/v1")
        if entry.runs:
            _log(f"  {'':<15} {entry.runs}")
    if tls and any(entry.openai_address for entry in mesh.services.values()):
        _log(f"  (HTTPS with the mesh CA: e.g. curl --cacert {mesh.tls['ca_file']} ...)")
    _log(authorization_summary(mesh))
    _log(f"state in {MeshFile.path(state_dir).absolute()}; stop with `{command_line(state_dir, 'down')}`")


def _on_loopback(address: str) -> bool:
    host = address.removeprefix("https://").removeprefix("http://").rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def authorization_summary(mesh: MeshFile) -> str:
    """One line: who may call what. Without TLS no RPC is authorized (a gateway checks API keys,
    nothing else checks anything), so it says whether every port is on loopback; with TLS, what
    a tenant and the operator present."""
    if mesh.tls_config().enabled:
        return (
            f"TLS: tenants (the SDK, `loramesh generate`) call the gateways with an API key and the "
            f"CA {mesh.tls['ca_file']} only, no certificate; operator RPCs and etcd take "
            f"{mesh.tls['cert_file']} (mesh.json's, the CLI's)"
        )
    entries = [*mesh.services.values(), *([mesh.etcd] if mesh.etcd is not None else [])]
    addresses = [
        mesh.etcd_endpoint,
        *(a for e in entries for a in (e.address, e.http_address, e.openai_address)),
    ]
    where = (
        "every port is on loopback (127.0.0.1): only this machine reaches them"
        if all(_on_loopback(a) for a in addresses if a)
        else "NOT every port is on loopback: anyone who reaches one is served"
    )
    return (
        f"no TLS: no RPC is authorized (the gateways check API keys, nothing else checks a caller); "
        f"{where}; `loramesh up --tls` for identities"
    )


def _gateway_keys_copy(args, state_dir: Path, admin_api_key: str) -> GatewayKeysCopy:
    """The gateways' tenants file, keys hashed (services/gateway/auth.py), in a 0600 file: the admin
    key and those of ``--api-keys-file``, with that file's tenant limits. No plain key reaches a
    gateway's argv, environment or disk."""
    source = Path(args.api_keys_file) if args.api_keys_file else None
    copy = GatewayKeysCopy(state_dir / "gateway-api-keys.json", admin_api_key, ADMIN_TENANT, source)
    try:
        copy.write()
    except (OSError, InvalidArgument) as error:
        message = error.message if isinstance(error, InvalidArgument) else str(error)
        raise CommandError(f"--api-keys-file: {message}") from None
    return copy


def _entry(
    name: str,
    supervisor: Supervisor,
    pid: int,
    address: str,
    http_address: str,
    log: str,
    openai_address: str = "",
    runs: str = "",
) -> ServiceEntry:
    tracker = supervisor.trackers[name]
    return ServiceEntry(
        address,
        http_address,
        pid if tracker.started_at is not None else 0,  # 0: down, waiting for its restart
        log,
        openai_address=openai_address,
        restarts=tracker.restarts,
        last_exit=describe_exit(tracker.last_exit_code),
        last_exit_unix=supervisor.last_exit_unix.get(name, 0.0),
        runs=runs,
    )


def _mesh_file(
    etcd: EtcdServer,
    processes: dict[str, ServiceProcess],
    openai_addresses: dict[str, str],
    supervisor: Supervisor,
    admin_api_key: str,
    ready: bool,
    certs: CertificateDirectory | None,
    runs: dict[str, str],
) -> MeshFile:
    """mesh.json as of now: addresses, the current pids, restarts and last exits, and what each
    worker runs (``runs``: by name)."""
    return MeshFile(
        up_pid=os.getpid(),
        etcd_endpoint=etcd.endpoint,
        etcd_pid=etcd.pid or 0,
        admin_api_key=admin_api_key,
        services={
            name: _entry(
                name,
                supervisor,
                p.pid or 0,
                p.address,
                p.http_address,
                str(p.log_path),
                openai_addresses.get(name, ""),
                runs.get(name, ""),
            )
            for name, p in processes.items()
        },
        ready=ready,
        gateway_addresses=[p.address for p in processes.values() if p.module == "gateway"],
        etcd=_entry(ETCD_UNIT, supervisor, etcd.pid or 0, etcd.endpoint, "", str(etcd.log_path)),
        tls=_client_tls_entry(certs),
    )


def _client_tls_entry(certs: CertificateDirectory | None) -> dict[str, str]:
    """mesh.json's ``tls``: the CA, and the operator's certificate, which the CLI presents to the
    internal ports and etcd (the SDK takes the CA alone: loramesh/targets.py)."""
    if certs is None:
        return {}
    tls = certs.tls_for(OPERATOR)
    return {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}


def _mesh_certificates(args, state_dir: Path) -> CertificateDirectory | None:
    """With ``--tls``: the state directory's CA and the etcd, etcd root and operator certificates,
    made now if any is missing (each service's own is made with its process: :func:`_instance_tls`)."""
    if not args.tls:
        return None
    certs = CertificateDirectory((state_dir / "certs").resolve())
    if not certs.complete(MESH_IDENTITIES):
        _log(f"creating the mesh CA and certificates in {certs.path}")
        create_mesh_certificates(certs.path, MESH_IDENTITIES)
    return certs


async def _wait_ready(name: str, process: ServiceProcess) -> None:
    """Until ``process`` serves; a one-line refusal naming it and its log when it cannot start
    (its log's tail printed first, for the diagnosis)."""
    try:
        await process.wait_ready(READY_TIMEOUT_S)
    except ServiceStartError as error:
        _log(str(error))
        raise CommandError(f"{name} did not start (log {Path(process.log_path).absolute()})") from None


async def _up_foreground(args, state_dir: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The state directory holds the admin key, etcd's data and the tenants' adapters: owner only.
    log_dir = private_dir(private_dir(state_dir) / "logs")
    certs = await asyncio.to_thread(_mesh_certificates, args, state_dir)
    etcd = EtcdServer(data_dir=state_dir / "etcd", tls=certs.tls_for("etcd") if certs is not None else NO_TLS)
    admin_api_key = admin_key(args)
    keys_copy = _gateway_keys_copy(args, state_dir, admin_api_key)
    keys_file = keys_copy.path.resolve()
    await asyncio.to_thread(etcd.start)
    processes, openai_addresses = await asyncio.to_thread(
        service_processes, args, state_dir, log_dir, etcd.endpoint, keys_file, certs
    )
    if certs is not None:  # etcd RBAC: each instance may write only its own keys
        instances = [MeshIdentity(p.module, name) for name, p in processes.items()]
        await provision_etcd_rbac(etcd.endpoint, certs.tls_for(ETCD_ROOT), instances)
    units = [EtcdUnit(ETCD_UNIT, etcd), *(ServiceUnit(name, p) for name, p in processes.items())]
    ready = False
    runs: dict[str, str] = {}

    def write_mesh_file() -> None:
        mesh = _mesh_file(etcd, processes, openai_addresses, supervisor, admin_api_key, ready, certs, runs)
        mesh.write(state_dir)
        write_prometheus_targets(mesh, state_dir)  # what monitoring/prometheus-up.yml scrapes

    supervisor = Supervisor(units, restart_policy(args), on_change=write_mesh_file)
    try:
        # The store replicas first, all at once, and every one ready before the rest start (the
        # first migrates an old SQLite catalog; gateways and workers start watching the catalog).
        stores = [name for name, p in processes.items() if p.module == STORE_KIND]
        for unit in units:
            if unit.name != ETCD_UNIT:
                unit.launch()
            supervisor.launched(unit)
            if unit.name == stores[-1]:
                await asyncio.gather(*(_wait_ready(name, processes[name]) for name in stores))
        await asyncio.gather(*(_wait_ready(name, p) for name, p in processes.items()))
        if modules := lora_modules(args):  # before `ready`: `up --detach` returns with them registered
            tenant_keys = {**plain_keys_by_tenant(args), ADMIN_TENANT: admin_api_key}
            gateways = [p.address for p in processes.values() if p.module == "gateway"]
            tls = ClientTLS(str(certs.ca_file)) if certs is not None else None  # a tenant's: the CA alone
            await asyncio.to_thread(
                register_lora_modules, modules, gateways, tenant_keys, tls, MeshFile.path(state_dir), _log
            )
        workers = [name for name, p in processes.items() if p.module == "gpu_worker"]
        operator_tls = certs.tls_for(OPERATOR) if certs is not None else NO_TLS
        runs.update(await read_worker_formats(etcd.endpoint, operator_tls, workers))
        ready = True
        write_mesh_file()
        print_summary(MeshFile.read(state_dir), state_dir)
        await asyncio.gather(supervisor.run(stop), keys_copy.follow(stop))
        _log("stopping the mesh")
    finally:
        # The supervisor has stopped: nothing is restarted while the services go down.
        await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in processes.values()))
        etcd.stop()
        MeshFile.remove(state_dir)
    return 0


def cmd_down(args) -> int:
    state_dir = Path(args.state_dir)
    mesh = MeshFile.read(state_dir)
    if (reason := why_not_live(state_dir, mesh)) is not None:
        MeshFile.remove(state_dir)
        raise CommandError(f"no mesh is up: {reason}; nothing to stop")
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
