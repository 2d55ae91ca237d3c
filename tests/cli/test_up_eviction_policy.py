"""`loramesh up --eviction-policy NAME` reaches the adapter store's and every gpu_worker's command
line (as a setting each parses) and the background `up` of `--detach`; without it they keep their
own default (lru)."""

from __future__ import annotations

from loramesh_cli.main import build_parser
from loramesh_cli.mesh_layout import service_processes
from loramesh_cli.up_arguments import detached_argv
from services.adapter_store.config import AdapterStoreConfig
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config


def service_configs(tmp_path, *flags: str) -> list[AdapterStoreConfig | WorkerConfig]:
    """The settings each store replica (two) and each of two workers parse from the command
    lines `up` builds."""
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--workers", "2", *flags])
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None)
    configs = []
    for process in processes.values():
        command = process.command()
        for module, config in (
            ("services.adapter_store", AdapterStoreConfig),
            ("services.gpu_worker", WorkerConfig),
        ):
            if module in command:
                configs.append(parse_config(config, argv=command[command.index(module) + 1 :], environ={}))
    return configs


def test_the_policy_reaches_the_store_and_every_worker(tmp_path):
    configs = service_configs(tmp_path, "--eviction-policy", "lfu")
    assert len(configs) == 4 and all(c.eviction_policy == "lfu" for c in configs)
    assert all(c.eviction_policy == "lru" for c in service_configs(tmp_path))


def test_detach_passes_it_to_the_background_up(tmp_path):
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--eviction-policy", "lfu"])
    argv = detached_argv(args, tmp_path)
    assert build_parser().parse_args(argv[argv.index("--state-dir") :]).eviction_policy == "lfu"
