"""``loramesh up``, ``down`` and ``status``: a local mesh on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from loramesh.tls import ClientTLS
from loramesh_cli.distkv_status import DISTKV_KEYS, POLICY_KEYS, distkv_table
from loramesh_cli.errors import CommandError
from loramesh_cli.lora_modules import LoraModule, import_grants, parse_lora_modules, register_lora_modules
from loramesh_cli.mesh_file import MeshFile, ServiceEntry, command_line, live_mesh, pid_alive, why_not_live
from loramesh_cli.restart_policy import RestartPolicy
from loramesh_cli.supervisor import EtcdUnit, ServiceUnit, Supervisor, describe_exit
from loramesh_cli.table import render_table
from loramesh_cli.tls_options import cli_tls
from services.adapter_store.config import AdapterStoreConfig
from services.gateway.auth import ApiKeys, TenantsFile, hashed_keys, is_hashed
from services.gpu_worker.engine.engine_config import KV_OVERFLOW_POLICIES
from services.gpu_worker.engine.policies import BATCH_POLICIES
from services.gpu_worker.engine.policies.preemption import PREEMPTION_POLICIES
from services.gpu_worker.quantization_setting import QUANTIZATION_CHOICES
from services.runtime.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.errors import InvalidArgument
from services.runtime.etcd_rbac import provision_etcd_rbac
from services.runtime.etcd_server import EtcdServer
from services.runtime.eviction import EVICTION_POLICIES
from services.runtime.identity import MeshIdentity
from services.runtime.membership import MembershipConfig, list_members, read_loads
from services.runtime.ports import free_port
from services.runtime.private_files import private_dir, write_private_text
from services.runtime.process import GRPC_SERVICE_NAMES, ServiceProcess, ServiceStartError
from services.runtime.server import check_health
from services.runtime.tls import NO_TLS, TLSConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.live_prediction import LivePredictions
from services.scheduler.policies import MIGRATION_POLICIES, PLACEMENT_POLICIES, PREFETCH_POLICIES

#: Tenant of the local admin key that `loramesh up` writes to mesh.json.
ADMIN_TENANT = "admin"

#: The certificate identity `loramesh` (CLI and SDK) presents to a `--tls` mesh.
ADMIN_IDENTITY = "admin"
#: The certificates of a `--tls` mesh beside each service's own: etcd's server and the operator's.
MESH_IDENTITIES = ("etcd", ADMIN_IDENTITY)

#: The supervisor's name for etcd's process.
ETCD_UNIT = "etcd"

#: How long `up` waits for every service to be ready: a guard against a hang, large because
#: nine processes loading on a busy 2-core machine take minutes.
READY_TIMEOUT_S = 300


def add_parsers(sub) -> None:
    up = sub.add_parser(
        "up",
        help="start etcd and every service on loopback and supervise them (in the foreground, or "
        "in the background with --detach)",
        description="Every flag's help says its default. Any other setting of a service reaches it "
        "through its LORAMESH_* variable in the environment of `loramesh up` (docs/operations.md).",
    )
    up.add_argument(
        "--model", default="", help="base model: GGUF file or HF directory (default SmolLM2-135M)"
    )
    up.add_argument("--workers", type=int, default=1,
                    help="gpu_workers (default 1); with --tp N, tensor-parallel groups")  # fmt: skip
    up.add_argument("--tp", type=int, default=1,
                    help="ranks of each worker's tensor-parallel group (default 1; must divide the "
                         "model's heads and hidden size: SmolLM2-135M 1 or 3)")  # fmt: skip
    up.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                    help="worker compute dtype (default auto: bf16 on CUDA or CPUs with native bf16, "
                         "else fp32)")  # fmt: skip
    up.add_argument("--quantization", default="auto", choices=list(QUANTIZATION_CHOICES),
                    help="base weights' format on CPU workers: q4_1 (GGUF Q4_1 blocks, exact over the "
                         "default model's Q4_1 file), q8_0, or none (dequantized to --dtype); auto: "
                         "the worker's default for its device (docs/operations.md, \"Quantized base\"; "
                         "default auto)")  # fmt: skip
    up.add_argument("--pool-mib", type=int, default=512, help="each worker's unified pool (default 512)")
    up.add_argument("--batch-policy", default="", choices=["", *sorted(BATCH_POLICIES)],
                    help="each worker's batch policy (docs/batch-policies.md; default: the worker's)")  # fmt: skip
    up.add_argument("--early-abort-slo-s", type=float, default=None, metavar="S",
                    help="first-token SLO of each worker's early_abort batch policy, in seconds "
                         "(default: the worker's, 6)")  # fmt: skip
    up.add_argument("--preemption-policy", default="", choices=["", *sorted(PREEMPTION_POLICIES)],
                    help="which running request each worker preempts when its pool runs dry "
                         "(default: the worker's, newest)")  # fmt: skip
    up.add_argument("--prefix-cache", default="", choices=["", "on", "off"],
                    help="each worker's prefix cache: requests sharing a prompt prefix and adapter "
                         "version reuse its KV (docs/operations.md; default: the worker's, on)")  # fmt: skip
    up.add_argument("--eviction-policy", default="", choices=["", *sorted(EVICTION_POLICIES)],
                    help="which adapters the adapter store's RAM tier and each worker's host cache and "
                         "pool drop first when full: lru, lfu or fifo; pinned adapters never "
                         "(docs/operations.md, \"Eviction and pinning\"; default: the services', lru)")  # fmt: skip
    up.add_argument("--kv-overflow", default="", choices=["", *KV_OVERFLOW_POLICIES],
                    help="what each worker does when its pool cannot hold a request's next KV block: "
                         "borrow (DistKV-LLM: blocks lent by other workers) or preempt (recompute "
                         "it later); docs/operations.md; default: borrow, preempt with "
                         "--kv-managers 0")  # fmt: skip
    up.add_argument("--lend-cap-blocks", type=int, default=None, metavar="N",
                    help="KV blocks other workers may borrow from each worker's pool at most; 0 lends "
                         "nothing (default: the worker's, -1: three quarters of its pool)")  # fmt: skip
    up.add_argument("--lending-lane", default="", choices=["", "shared-memory", "socket", "off"],
                    help="how borrowing steps reach creditors on the same host: shared-memory (their "
                         "pools mapped, borrowed blocks attended in place; the socket with --tls), "
                         "socket (per-layer calls over their Unix-socket lane) or off (gRPC); "
                         "docs/operations.md; default: the worker's, shared-memory")  # fmt: skip
    up.add_argument("--lend-compute-share", type=float, default=None, metavar="S",
                    help="share of its time, in [0, 1], each worker may spend computing attention over "
                         "lent blocks while it has requests of its own; beyond it debtors recompute "
                         "(DistKV-LLM's compute cap; default: the worker's, 0.5; 1: no cap)")  # fmt: skip
    up.add_argument("--deterministic", action="store_true",
                    help="batch-invariant numerics on every worker: a request's output does not depend "
                         "on its batch (CPU workers; docs/operations.md; default off)")  # fmt: skip
    up.add_argument("--placement", default=SchedulerConfig.placement, choices=sorted(PLACEMENT_POLICIES),
                    help="the schedulers' placement policy (docs/operations.md; default "
                         f"{SchedulerConfig.placement})")  # fmt: skip
    up.add_argument("--migration", default="none", choices=["none", *sorted(MIGRATION_POLICIES)],
                    help="the schedulers' migration policy (docs/operations.md; default none)")  # fmt: skip
    up.add_argument("--prefetch", default="none", choices=["none", *sorted(PREFETCH_POLICIES)],
                    help="the schedulers' adapter prefetch policy (default none)")  # fmt: skip
    up.add_argument("--length-predictor", default="none", choices=["none", LivePredictions.name],
                    help="the schedulers' output-length predictor (Magnus; needs loramesh[predictor]; "
                         "default none)")  # fmt: skip
    up.add_argument("--api-keys-file", default="", metavar="FILE",
                    help="the gateways' tenants file: JSON {api key: tenant}, or {\"keys\": {api key: tenant}, "
                         "\"tenants\": {tenant: limits}} with per-tenant limits (docs/operations.md, "
                         "\"Tenants and quotas\"), besides the admin key (default none)")  # fmt: skip
    up.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR|URI",
                    help="adapters to register once the mesh is ready, as vLLM's flag: NAME for the admin "
                         "tenant, OWNER/NAME for a tenant whose plain key is in --api-keys-file; DIR is a "
                         "PEFT directory, relative to the working directory; a URI (s3://, hf://, file://) "
                         "is imported by the adapter store (default none)")  # fmt: skip
    up.add_argument("--import-policy-file", default="", metavar="FILE",
                    help="the adapter store's import policy (which tenant may import from which s3://, "
                         "hf://, file:// sources; docs/operations.md); default: one up writes, granting "
                         "each --lora-modules URI to its owner and the admin tenant file:// under each "
                         "--adapter-load-dirs directory, nothing else")  # fmt: skip
    up.add_argument("--adapter-load-dirs", default="", metavar="DIR[,DIR...]",
                    help="directories under which the gateways' POST /v1/load_lora_adapter may read a "
                         "lora_path, comma-separated, relative to the working directory (default none: "
                         "loading by path is refused)")  # fmt: skip
    up.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                    help="largest LoRA rank the adapter store accepts at registration (default: the "
                         f"store's, {AdapterStoreConfig.max_rank})")  # fmt: skip
    up.add_argument("--openai-port", type=int, default=0, metavar="PORT",
                    help="the first gateway's OpenAI-compatible HTTP port on 127.0.0.1; the other "
                         "gateways take free ports (default 0: a free port)")  # fmt: skip
    up.add_argument("--detach", action="store_true",
                    help="run in the background; return once ready (default off: in the foreground "
                         "until Ctrl-C)")  # fmt: skip
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS between every service, to etcd and from clients; certificates "
                         "in <state dir>/certs, made if absent (`loramesh certs`; default off)")  # fmt: skip
    up.add_argument("--ram-budget-mib", type=int, default=1024,
                    help="adapter store RAM tier (default 1024)")  # fmt: skip
    up.add_argument("--gateways", type=int, default=2,
                    help="gateway processes (default 2: one can die while the other serves)")  # fmt: skip
    up.add_argument("--schedulers", type=int, default=2, help="scheduler replicas (default 2)")
    up.add_argument("--kv-managers", type=int, default=2,
                    help="kv_manager replicas, one active (default 2)")  # fmt: skip
    defaults = RestartPolicy()
    up.add_argument("--restart-backoff-s", type=float, default=defaults.initial_backoff_s,
                    help=f"wait before restarting a process that died (default {defaults.initial_backoff_s:g})")  # fmt: skip
    up.add_argument("--restart-backoff-max-s", type=float, default=defaults.max_backoff_s,
                    help="cap of the restart wait, which doubles per crash in a row "
                         f"(default {defaults.max_backoff_s:g})")  # fmt: skip
    up.add_argument("--restart-healthy-s", type=float, default=defaults.healthy_after_s,
                    help=f"a run this long resets the restart wait (default {defaults.healthy_after_s:g})")  # fmt: skip
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
    if why_not_live(state_dir, mesh) is None:
        raise CommandError(
            f"a mesh is already up (pid {mesh.up_pid}, {MeshFile.path(state_dir).absolute()}); "
            f"run `{command_line(state_dir, 'down')}` first"
        )
    MeshFile.remove(state_dir)


def cmd_up(args) -> int:
    state_dir = Path(args.state_dir)
    for flag in ("workers", "gateways", "schedulers", "kv_managers"):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.lend_cap_blocks is not None and args.lend_cap_blocks < -1:
        raise CommandError(f"--lend-cap-blocks must be -1 (auto), 0 or more, got {args.lend_cap_blocks}")
    if args.lend_compute_share is not None and not 0 <= args.lend_compute_share <= 1:
        raise CommandError(f"--lend-compute-share must be in [0, 1], got {args.lend_compute_share}")
    if args.early_abort_slo_s is not None and not args.early_abort_slo_s > 0:
        raise CommandError(f"--early-abort-slo-s must be more than 0, got {args.early_abort_slo_s}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise CommandError(f"--max-lora-rank must be at least 1, got {args.max_lora_rank}")
    try:
        _restart_policy(args)
    except ValueError as error:
        raise CommandError(f"restart backoff: {error}") from None
    # Every path and port named on the command line is checked before anything starts.
    _lora_modules(args)
    _adapter_load_dirs(args)
    if args.import_policy_file and not Path(args.import_policy_file).is_file():
        raise CommandError(f"--import-policy-file: {Path(args.import_policy_file).resolve()} is not a file")
    _check_openai_port(args.openai_port)
    _check_not_running(state_dir)
    if args.detach:
        return _up_detached(args, state_dir)
    return asyncio.run(_up_foreground(args, state_dir))


def _lora_modules(args) -> list[LoraModule]:
    """``--lora-modules``, each directory checked and made absolute."""
    return parse_lora_modules(args.lora_modules, ADMIN_TENANT, _plain_keys_by_tenant(args))


def _adapter_load_dirs(args) -> str:
    """``--adapter-load-dirs`` as the gateways take it: comma-separated, each directory checked
    and made absolute (a service's working directory need not be the user's)."""
    directories = [
        Path(d.strip()).expanduser().resolve() for d in args.adapter_load_dirs.split(",") if d.strip()
    ]
    for directory in directories:
        if not directory.is_dir():
            raise CommandError(f"--adapter-load-dirs: {directory} is not a directory")
    return ",".join(str(d) for d in directories)


def _plain_keys_by_tenant(args) -> dict[str, str]:
    """Tenant → API key of ``--api-keys-file``'s plain (unhashed) keys: what `up` can register a
    tenant's ``--lora-modules`` with."""
    if not args.api_keys_file:
        return {}
    try:
        keys = ApiKeys.read_file(args.api_keys_file)
    except (OSError, ValueError, InvalidArgument) as error:
        raise CommandError(f"--api-keys-file: {error}") from None
    return {tenant: key for key, tenant in keys.items() if not is_hashed(key)}


def _check_openai_port(port: int) -> None:
    """Refuses an ``--openai-port`` out of range or taken, before anything starts (a gateway that
    cannot bind it would only fail in its log)."""
    if not 0 <= port <= 65535:
        raise CommandError(f"--openai-port must be in [0, 65535], got {port}")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway's server binds
        try:
            probe.bind((ServiceProcess.host, port))
        except OSError as error:
            raise CommandError(
                f"--openai-port {port}: {ServiceProcess.host}:{port} is taken ({error.strerror})"
            ) from None


def _up_detached(args, state_dir: Path) -> int:
    # The state directory holds the admin key, etcd's data and the tenants' adapters: owner only.
    log_dir = private_dir(private_dir(state_dir) / "logs")
    log_path = (log_dir / "up.log").absolute()
    argv = _detached_argv(args, state_dir)
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


def _detached_argv(args, state_dir: Path) -> list[str]:
    """The foreground `up` that `up --detach` runs in the background, with the same settings."""
    argv = [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state_dir), "up"]
    if args.model:
        argv += ["--model", args.model]
    argv += [
        "--ram-budget-mib",
        str(args.ram_budget_mib),
        "--workers",
        str(args.workers),
        "--tp",
        str(args.tp),
    ]
    argv += ["--dtype", args.dtype, "--quantization", args.quantization, "--pool-mib", str(args.pool_mib)]
    argv += _batch_policy_flags(args) + _prefix_cache_flags(args) + _kv_overflow_flags(args)
    argv += _eviction_flags(args)
    if args.deterministic:
        argv += ["--deterministic"]
    argv += ["--gateways", str(args.gateways), "--schedulers", str(args.schedulers), *_scheduler_flags(args)]
    argv += ["--kv-managers", str(args.kv_managers), "--restart-backoff-s", str(args.restart_backoff_s)]
    argv += ["--restart-backoff-max-s", str(args.restart_backoff_max_s)]
    argv += ["--restart-healthy-s", str(args.restart_healthy_s)]
    if args.api_keys_file:
        argv += ["--api-keys-file", str(Path(args.api_keys_file).resolve())]
    if modules := _lora_modules(args):
        argv += ["--lora-modules", *(f"{m.owner}/{m.name}={m.source}" for m in modules)]
    if args.import_policy_file:
        argv += ["--import-policy-file", str(Path(args.import_policy_file).resolve())]
    if load_dirs := _adapter_load_dirs(args):
        argv += ["--adapter-load-dirs", load_dirs]
    if args.max_lora_rank is not None:
        argv += ["--max-lora-rank", str(args.max_lora_rank)]
    argv += ["--openai-port", str(args.openai_port)]
    if args.tls:
        argv += ["--tls"]
    return argv


def print_summary(mesh: MeshFile, state_dir: Path) -> None:
    """What `up` prints once the mesh is ready: every process's addresses, then where its state
    is and how to stop it (with the ``--state-dir`` it was started with)."""
    _log(f"mesh up (pid {mesh.up_pid}); etcd {mesh.etcd_endpoint}")
    # With --tls the side ports and the OpenAI port speak HTTPS only (the mesh CA's certificates).
    tls = mesh.tls_config().enabled
    scheme = "https" if tls else "http"
    for name, entry in mesh.services.items():
        _log(f"  {name:<14} grpc {entry.address}  {scheme} {entry.http_address}  log {entry.log}")
        if entry.openai_address:
            _log(f"  {'':<14} OpenAI API {scheme}://{entry.openai_address}/v1")
    if tls and any(entry.openai_address for entry in mesh.services.values()):
        _log(f"  (HTTPS with the mesh CA: e.g. curl --cacert {mesh.tls['ca_file']} ...)")
    _log(f"state in {MeshFile.path(state_dir).absolute()}; stop with `{command_line(state_dir, 'down')}`")


def _restart_policy(args) -> RestartPolicy:
    return RestartPolicy(
        initial_backoff_s=args.restart_backoff_s,
        max_backoff_s=args.restart_backoff_max_s,
        healthy_after_s=args.restart_healthy_s,
    )


def _batch_policy_flags(args) -> list[str]:
    """``--batch-policy NAME``, ``--early-abort-slo-s S`` and ``--preemption-policy NAME`` when
    `up` was given them; none leaves the workers' defaults."""
    flags = ["--batch-policy", args.batch_policy] if args.batch_policy else []
    if args.early_abort_slo_s is not None:
        flags += ["--early-abort-slo-s", str(args.early_abort_slo_s)]
    return flags + (["--preemption-policy", args.preemption_policy] if args.preemption_policy else [])


def _kv_overflow_flags(args) -> list[str]:
    """``--kv-overflow``: as given, else borrow wherever a kv_manager runs to suggest creditors
    (preempt without one); ``--lend-cap-blocks N``, ``--lend-compute-share S`` and
    ``--lending-lane`` when `up` was given them, else the workers' defaults."""
    policy = args.kv_overflow or ("borrow" if args.kv_managers > 0 else "preempt")
    flags = ["--kv-overflow", policy]
    if args.lend_cap_blocks is not None:
        flags += ["--lend-cap-blocks", str(args.lend_cap_blocks)]
    if args.lend_compute_share is not None:
        flags += ["--lend-compute-share", repr(args.lend_compute_share)]
    if args.lending_lane:
        flags += ["--lending-lane", args.lending_lane]
    return flags


def _prefix_cache_flags(args) -> list[str]:
    """``--prefix-cache on|off`` when `up` was given it; none leaves the workers' default."""
    return ["--prefix-cache", args.prefix_cache] if args.prefix_cache else []


def _eviction_flags(args) -> list[str]:
    """``--eviction-policy NAME`` when `up` was given it; none leaves the services' default."""
    return ["--eviction-policy", args.eviction_policy] if args.eviction_policy else []


def _deterministic_flags(args) -> list[str]:
    """``--deterministic true`` when `up` was given ``--deterministic``; none leaves the workers' default."""
    return ["--deterministic", "true"] if args.deterministic else []


def _scheduler_flags(args) -> list[str]:
    """The schedulers' placement, migration, prefetch and length-prediction policies, as `up` was
    given them."""
    return [
        "--placement",
        args.placement,
        "--migration",
        args.migration,
        "--prefetch",
        args.prefetch,
        "--length-predictor",
        args.length_predictor,
    ]


def replica_name(kind: str, index: int) -> str:
    """The first replica keeps the kind's name (what single-instance readers of mesh.json look
    up); the others are ``<kind>-<index>``."""
    return kind if index == 0 else f"{kind}-{index}"


def _service_processes(
    args,
    state_dir: Path,
    log_dir: Path,
    etcd_endpoint: str,
    keys_file: Path,
    certs: CertificateDirectory | None,
) -> tuple[dict[str, ServiceProcess], dict[str, str]]:
    """Every service of the mesh, by name (also its instance id), the adapter store first, and
    each gateway's OpenAI API address. Ports are picked now and kept, so a restarted process
    comes back at the same address. With ``certs``, each runs with mutual TLS as its own
    instance (``<kind>/<name>``: services/runtime/identity.py).

    Each process inherits the environment of `up`, so any setting `up` has no flag for reaches
    its services as their ``LORAMESH_*`` variable; a flag passed here wins over it."""

    def service(kind: str, name: str, flags: list[str], env: dict[str, str] | None = None) -> ServiceProcess:
        return ServiceProcess(
            kind,
            [*flags, "--instance-id", name],
            log_path=log_dir / f"{name}.log",
            env=env,
            tls=_instance_tls(certs, MeshIdentity(kind, name)),
        )

    etcd_flags = ["--etcd-endpoints", etcd_endpoint]
    model_flags = ["--model", args.model] if args.model else []
    processes = {
        "adapter_store": service(
            "adapter_store", "adapter_store",
            [*etcd_flags, "--data-dir", str(state_dir / "adapter_store"),
             "--ram-budget-mib", str(args.ram_budget_mib), *_max_rank_flags(args), *_eviction_flags(args),
             *model_flags,
             "--import-policy-file", _import_policy_file(args, state_dir)],
        )
    }  # fmt: skip
    store_flags = ["--adapter-store", processes["adapter_store"].address]
    # Workers sharing one machine's cores split them rather than oversubscribe (CPU serving); a
    # tensor-parallel group splits its share again between its ranks.
    threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
    for i in range(args.workers):
        processes[f"gpu_worker-{i}"] = service(
            "gpu_worker", f"gpu_worker-{i}",
            [*etcd_flags, *store_flags, "--dtype", args.dtype, "--quantization", args.quantization,
             "--pool-mib", str(args.pool_mib),
             "--threads", str(threads), "--tp", str(args.tp), *_batch_policy_flags(args), *_deterministic_flags(args), *_prefix_cache_flags(args),
             *_kv_overflow_flags(args), *_eviction_flags(args), *model_flags],
        )  # fmt: skip
    # Schedulers are stateless replicas: each gateway finds a live one in etcd (docs/operations.md).
    for i in range(args.schedulers):
        name = replica_name("scheduler", i)
        processes[name] = service("scheduler", name, [*etcd_flags, *_scheduler_flags(args)])
    # DistKV-LLM's gManager: the workers' KV-block debt ledger; the replicas elect one leader.
    for i in range(args.kv_managers):
        name = replica_name("kv_manager", i)
        processes[name] = service("kv_manager", name, etcd_flags)
    gateway_flags = [*etcd_flags, *store_flags, *model_flags, "--api-keys-file", str(keys_file)]
    if load_dirs := _adapter_load_dirs(args):
        gateway_flags += ["--adapter-load-dirs", load_dirs]
    openai_addresses = {}
    for i in range(args.gateways):
        name = replica_name("gateway", i)
        openai_port = args.openai_port if i == 0 and args.openai_port else free_port()
        processes[name] = service("gateway", name, [*gateway_flags, "--openai-port", str(openai_port)])
        openai_addresses[name] = f"{processes[name].host}:{openai_port}"
    return processes, openai_addresses


def _import_policy_file(args, state_dir: Path) -> str:
    """The store's import policy: ``--import-policy-file`` as given, else one `up` writes that
    grants each ``--lora-modules`` URI to its owner and the admin tenant ``file://`` under each
    ``--adapter-load-dirs`` directory (the directories the operator already opened to loading)."""
    if args.import_policy_file:
        return str(Path(args.import_policy_file).resolve())
    grants = import_grants(_lora_modules(args))
    for directory in filter(None, _adapter_load_dirs(args).split(",")):
        grants.setdefault(ADMIN_TENANT, []).append(Path(directory).as_uri())
    path = state_dir / "import-policy.json"
    write_private_text(path, json.dumps({"tenants": grants}, indent=2))
    return str(path.resolve())


def _max_rank_flags(args) -> list[str]:
    """The store's ``--max-rank N`` when `up` was given ``--max-lora-rank N``; none leaves the
    store's default (or its ``LORAMESH_MAX_RANK``)."""
    return ["--max-rank", str(args.max_lora_rank)] if args.max_lora_rank is not None else []


def _gateway_keys_file(args, state_dir: Path, admin_api_key: str) -> Path:
    """The gateways' tenants file, keys hashed (services/gateway/auth.py), in a 0600 file: the admin
    key and those of ``--api-keys-file``, with that file's tenant limits. No plain key reaches a
    gateway's argv, environment or disk."""
    keys = {admin_api_key: ADMIN_TENANT}
    given = TenantsFile({})
    if args.api_keys_file:
        try:
            given = TenantsFile.read(args.api_keys_file)
        except (OSError, ValueError, InvalidArgument) as error:
            raise CommandError(f"--api-keys-file: {error}") from None
        keys.update(given.keys)
    path = state_dir / "gateway-api-keys.json"
    write_private_text(path, json.dumps(TenantsFile(hashed_keys(keys), given.quotas).to_json(), indent=2))
    return path.resolve()


def _entry(
    name: str,
    supervisor: Supervisor,
    pid: int,
    address: str,
    http_address: str,
    log: str,
    openai_address: str = "",
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
    )


def _mesh_file(
    etcd: EtcdServer,
    processes: dict[str, ServiceProcess],
    openai_addresses: dict[str, str],
    supervisor: Supervisor,
    admin_api_key: str,
    ready: bool,
    certs: CertificateDirectory | None,
) -> MeshFile:
    """mesh.json as of now: addresses, the current pids, restarts and last exits."""
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
            )
            for name, p in processes.items()
        },
        ready=ready,
        gateway_addresses=[p.address for p in processes.values() if p.module == "gateway"],
        etcd=_entry(ETCD_UNIT, supervisor, etcd.pid or 0, etcd.endpoint, "", str(etcd.log_path)),
        tls=_client_tls_entry(certs),
    )


def _client_tls_entry(certs: CertificateDirectory | None) -> dict[str, str]:
    """What a client of a ``--tls`` mesh presents: the ``admin`` identity (mesh.json's ``tls``)."""
    if certs is None:
        return {}
    tls = certs.tls_for(ADMIN_IDENTITY)
    return {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}


def _mesh_certificates(args, state_dir: Path) -> CertificateDirectory | None:
    """With ``--tls``: the state directory's CA and the etcd and admin certificates, made now if
    any is missing (each service's own is made with its process: :func:`_instance_tls`)."""
    if not args.tls:
        return None
    certs = CertificateDirectory((state_dir / "certs").resolve())
    if not certs.complete(MESH_IDENTITIES):
        _log(f"creating the mesh CA and certificates in {certs.path}")
        create_mesh_certificates(certs.path, MESH_IDENTITIES)
    return certs


def _instance_tls(certs: CertificateDirectory | None, identity: MeshIdentity) -> TLSConfig:
    """A process's TLS settings: its own instance's certificate (made if missing), or none."""
    if certs is None:
        return NO_TLS
    if not certs.complete((identity,)):
        create_mesh_certificates(certs.path, (identity,))
    return certs.tls_for(identity)


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
    admin_api_key = "lm-admin-" + secrets.token_urlsafe(18)
    keys_file = _gateway_keys_file(args, state_dir, admin_api_key)
    await asyncio.to_thread(etcd.start)
    processes, openai_addresses = await asyncio.to_thread(
        _service_processes, args, state_dir, log_dir, etcd.endpoint, keys_file, certs
    )
    if certs is not None:  # etcd RBAC: each instance may write only its own keys
        instances = [MeshIdentity(p.module, name) for name, p in processes.items()]
        await provision_etcd_rbac(etcd.endpoint, certs.tls_for(ADMIN_IDENTITY), instances)
    units = [EtcdUnit(ETCD_UNIT, etcd), *(ServiceUnit(name, p) for name, p in processes.items())]
    ready = False

    def write_mesh_file() -> None:
        _mesh_file(etcd, processes, openai_addresses, supervisor, admin_api_key, ready, certs).write(
            state_dir
        )

    supervisor = Supervisor(units, _restart_policy(args), on_change=write_mesh_file)
    try:
        for unit in units:
            if unit.name != ETCD_UNIT:
                unit.launch()
            supervisor.launched(unit)
            if unit.name == "adapter_store":
                await _wait_ready(unit.name, processes["adapter_store"])
        await asyncio.gather(*(_wait_ready(name, p) for name, p in processes.items()))
        if modules := _lora_modules(args):  # before `ready`: `up --detach` returns with them registered
            tenant_keys = {**_plain_keys_by_tenant(args), ADMIN_TENANT: admin_api_key}
            gateways = [p.address for p in processes.values() if p.module == "gateway"]
            tls = ClientTLS.from_mapping(_client_tls_entry(certs)) if certs is not None else None
            await asyncio.to_thread(
                register_lora_modules, modules, gateways, tenant_keys, tls, MeshFile.path(state_dir), _log
            )
        ready = True
        write_mesh_file()
        print_summary(MeshFile.read(state_dir), state_dir)
        await supervisor.run(stop)
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
                        if k not in DISTKV_KEYS and k not in POLICY_KEYS
                    ),
                ]
                for r in rows
            ],
        )
    )
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
