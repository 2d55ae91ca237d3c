"""The processes of a local mesh (`loramesh up`): their names, and each one's command line from
`up`'s flags."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path

from loramesh_cli.config_flags import setting_flags
from loramesh_cli.errors import CommandError
from loramesh_cli.lora_modules import import_grants
from loramesh_cli.up_arguments import (
    ADMIN_TENANT,
    GATEWAY_SETTINGS,
    SCHEDULER_SETTINGS,
    STORE_SETTINGS,
    WORKER_SETTINGS,
    adapter_load_dirs,
    lora_modules,
    worker_memory,
)
from services.adapter_store.config import AdapterStoreConfig
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.tp.layout import TensorParallelLayout
from services.kv_manager.config import KVManagerConfig
from services.model_files.base_model import load_base_model_spec
from services.model_files.cache_dir import CACHE_ENV
from services.runtime.config import ServiceConfig, SettingError, read_config, setting_variables
from services.runtime.process.ports import free_port
from services.runtime.process.process import ServiceProcess
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.private_files import write_private_text
from services.runtime.security.tls import NO_TLS, TLSConfig
from services.scheduler.config import SchedulerConfig

#: The supervisor's name for etcd's process.
ETCD_UNIT = "etcd"
#: The adapter store's kind: its first replica's process name, the others' prefix.
STORE_KIND = "adapter_store"
#: Each kind's settings: the ``LORAMESH_*`` variables of `up`'s environment its processes get.
SERVICE_CONFIGS: dict[str, type[ServiceConfig]] = {
    STORE_KIND: AdapterStoreConfig,
    "gpu_worker": WorkerConfig,
    "scheduler": SchedulerConfig,
    "kv_manager": KVManagerConfig,
    "gateway": GatewayConfig,
}


def service_variables(kind: str) -> frozenset[str]:
    """The ``LORAMESH_*`` variables a process of ``kind`` reads: its settings', and the cache
    directory of what every service derives from the base model."""
    return setting_variables(SERVICE_CONFIGS[kind]) | {CACHE_ENV}


def replica_name(kind: str, index: int) -> str:
    """The first replica keeps the kind's name (what single-instance readers of mesh.json look
    up); the others are ``<kind>-<index>``."""
    return kind if index == 0 else f"{kind}-{index}"


def service_processes(
    args,
    state_dir: Path,
    log_dir: Path,
    etcd_endpoint: str,
    keys_file: Path,
    certs: CertificateDirectory | None,
) -> tuple[dict[str, ServiceProcess], dict[str, str]]:
    """Every service of the mesh, by name (also its instance id), the adapter store replicas
    first, and each gateway's OpenAI API address. Ports are picked now and kept, so a restarted
    process comes back at the same address. With ``certs``, each runs with mutual TLS as its own
    instance (``<kind>/<name>``: services/runtime/security/identity.py).

    Each process gets the part of `up`'s environment it needs
    (services/runtime/process/child_environment.py), its service's ``LORAMESH_*`` variables
    among it, so any setting `up` has no flag for reaches its services as their variable; a flag
    passed here wins over it. Cloud credentials reach the adapter store alone."""

    def service(kind: str, name: str, flags: list[str], host: str = ServiceProcess.host) -> ServiceProcess:
        return ServiceProcess(
            kind,
            [*flags, "--instance-id", name],
            log_path=log_dir / f"{name}.log",
            host=host,
            settings=service_variables(kind),
            tls=instance_tls(certs, MeshIdentity(kind, name)),
        )

    etcd_flags = ["--etcd-endpoints", etcd_endpoint]
    # The stores read the gateways' tenants file too: its limits on what each tenant stores.
    processes = {
        name: service(STORE_KIND, name, [*etcd_flags, *flags, "--tenants-file", str(keys_file)])
        for name, flags in store_replica_flags(args, state_dir).items()
    }
    # One store: the gateways and workers are given its address. Several: they find the live
    # ones in etcd, and another one when theirs goes away (docs/operations.md).
    store_flags = ["--adapter-store", processes[STORE_KIND].address] if args.adapter_stores == 1 else []
    # Workers sharing one machine's cores split them rather than oversubscribe (CPU serving); a
    # tensor-parallel group splits its share again between its ranks.
    threads = max(1, (os.cpu_count() or 1) // max(1, args.workers))
    for i in range(args.workers):
        processes[f"gpu_worker-{i}"] = service(
            "gpu_worker", f"gpu_worker-{i}", [*etcd_flags, *store_flags, "--threads", str(threads), *_worker_flags(args)]
        )  # fmt: skip
    # Schedulers are stateless replicas: each gateway finds a live one in etcd (docs/operations.md).
    for i in range(args.schedulers):
        name = replica_name("scheduler", i)
        processes[name] = service(
            "scheduler", name, [*etcd_flags, *setting_flags(args, [SCHEDULER_SETTINGS])]
        )
    # DistKV-LLM's gManager: the workers' KV-block debt ledger; the replicas elect one leader.
    for i in range(args.kv_managers):
        name = replica_name("kv_manager", i)
        processes[name] = service("kv_manager", name, etcd_flags)
    gateway_flags = [*etcd_flags, *store_flags, *setting_flags(args, [GATEWAY_SETTINGS]), "--api-keys-file", str(keys_file)]  # fmt: skip
    if load_dirs := adapter_load_dirs(args):
        gateway_flags += ["--adapter-load-dirs", load_dirs]
    openai_addresses = {}
    for i in range(args.gateways):
        name = replica_name("gateway", i)
        openai_port = args.openai_port if i == 0 and args.openai_port else free_port(args.host)
        # --host: where a client reaches the gateways, the rest of the mesh staying on loopback.
        processes[name] = service(
            "gateway", name, [*gateway_flags, "--openai-port", str(openai_port)], args.host
        )
        openai_addresses[name] = f"{processes[name].host}:{openai_port}"
    return processes, openai_addresses


def check_service_settings(args, environ: Mapping[str, str]) -> None:
    """Each kind's settings as its processes will read them, before any starts: the settings
    `up` passes on as flags and the kind's ``LORAMESH_*`` variables in ``environ`` (`up`'s). A
    value the service would refuse is refused here in one line naming the service and the
    setting, instead of as a process that exits at start."""
    flags = {
        STORE_KIND: [*setting_flags(args, [STORE_SETTINGS]), *_max_rank_flags(args)],
        "gpu_worker": _worker_flags(args),
        "scheduler": setting_flags(args, [SCHEDULER_SETTINGS]),
        "kv_manager": [],
        "gateway": setting_flags(args, [GATEWAY_SETTINGS]),
    }
    for kind, config in SERVICE_CONFIGS.items():
        try:
            settings = read_config(config, flags[kind], environ)
        except SettingError as error:
            raise CommandError(f"{kind}: {error}") from None
        if isinstance(settings, WorkerConfig) and settings.tp > 1:
            _check_tp_degree(settings)


def _check_tp_degree(worker: WorkerConfig) -> None:
    """A tensor-parallel degree the base model does not divide, refused before any worker loads
    the model: the workers' own check, over the model's dimensions (its spec, cached on disk)."""
    try:
        TensorParallelLayout.for_config(load_base_model_spec(worker.model or None), worker.tp)
    except (OSError, ValueError) as error:
        raise CommandError(f"gpu_worker: {error}") from None


def store_replica_flags(args, state_dir: Path) -> dict[str, list[str]]:
    """Each adapter store replica's flags but etcd's, by name. The replicas share one catalog
    (in etcd) and one blob tier, so any of them serves any adapter: ``--blob-store`` as given
    (a directory made absolute), else ``<state dir>/adapter_store`` (where the blobs of a
    one-store mesh have always been). Each has a data directory of its own (the disk cache in
    front of a bucket): ``<state dir>/adapter_store`` for the first, which also migrates a
    SQLite catalog of the single-replica store found there, ``<state dir>/adapter_store-N``
    for the others."""
    blob_store = args.blob_store or str(state_dir / STORE_KIND)
    if "://" not in blob_store:
        blob_store = str(Path(blob_store).expanduser().resolve())
    shared = [
        "--blob-store", blob_store,
        # --blob-store is passed above, resolved; the store's other settings as given.
        *setting_flags(argparse.Namespace(**{**vars(args), "blob_store": None}), [STORE_SETTINGS]),
        *_max_rank_flags(args), "--import-policy-file", _import_policy_file(args, state_dir),
    ]  # fmt: skip
    return {
        replica_name(STORE_KIND, i): ["--data-dir", str(state_dir / replica_name(STORE_KIND, i)), *shared]
        for i in range(args.adapter_stores)
    }


def _worker_flags(args) -> list[str]:
    """The workers' settings `up` was given; ``--kv-overflow`` as given, else borrow wherever a
    kv_manager runs to suggest creditors (preempt without one)."""
    flags = setting_flags(argparse.Namespace(**{**vars(args), **worker_memory(args)}), [WORKER_SETTINGS])
    if args.kv_overflow is None:
        flags += ["--kv-overflow", "borrow" if args.kv_managers > 0 else "preempt"]
    return flags


def _max_rank_flags(args) -> list[str]:
    """The store's ``--max-rank N`` when `up` was given ``--max-lora-rank N``; none leaves the
    store's default (or its ``LORAMESH_MAX_RANK``)."""
    return ["--max-rank", str(args.max_lora_rank)] if args.max_lora_rank is not None else []


def _import_policy_file(args, state_dir: Path) -> str:
    """The store's import policy: ``--import-policy-file`` as given, else one `up` writes that
    grants each ``--lora-modules`` URI to its owner and the admin tenant ``file://`` under each
    ``--adapter-load-dirs`` directory (the directories the operator already opened to loading)."""
    if args.import_policy_file:
        return str(Path(args.import_policy_file).resolve())
    grants = import_grants(lora_modules(args))
    for directory in filter(None, adapter_load_dirs(args).split(",")):
        grants.setdefault(ADMIN_TENANT, []).append(Path(directory).as_uri())
    path = state_dir / "import-policy.json"
    write_private_text(path, json.dumps({"tenants": grants}, indent=2))
    return str(path.resolve())


def instance_tls(certs: CertificateDirectory | None, identity: MeshIdentity) -> TLSConfig:
    """A process's TLS settings: its own instance's certificate (made if missing), or none."""
    if certs is None:
        return NO_TLS
    if not certs.complete((identity,)):
        create_mesh_certificates(certs.path, (identity,))
    return certs.tls_for(identity)
