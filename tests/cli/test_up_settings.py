"""`loramesh up` sets what its services can: ``--adapter-load-dirs`` (the gateways'),
``--max-lora-rank`` (the store's ``--max-rank``), ``--openai-port`` (the first gateway's) and
``--lora-modules NAME=DIR`` (registered once the mesh is ready), and the store's blob tier
(``--blob-store`` and its collection; its catalog is in up's etcd). Paths are resolved against
the working directory of ``up`` and checked before anything starts; any other setting reaches
the services through its ``LORAMESH_*`` variable, which every process inherits from ``up``.

Each setting is read back the way the service reads it: :func:`parse_config` of the command line
`up` builds, with the environment the process is started with.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import COMMAND_TIMEOUT_S

from loramesh_cli.main import build_parser, main
from loramesh_cli.mesh_layout import service_processes
from loramesh_cli.up_arguments import detached_argv
from services.adapter_store.config import AdapterStoreConfig
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config
from services.runtime.process import process as process_module
from services.runtime.process.ports import free_port


def up_args(tmp_path, *flags: str):
    return build_parser().parse_args(["--state-dir", str(tmp_path / "state"), "up", *flags])


def processes_of(tmp_path, *flags: str):
    processes, openai_addresses = service_processes(
        up_args(tmp_path, *flags), tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None
    )
    return processes, openai_addresses


def service_flags(process) -> list[str]:
    """A service's flags, as `python -m services.<kind>` gets them."""
    command = process.command()
    return command[command.index(f"services.{process.module}") + 1 :]


def adapter_dir(path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return str(path)


def test_the_flags_reach_the_services(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loras").mkdir()
    port = free_port()
    processes, openai_addresses = processes_of(
        tmp_path, "--adapter-load-dirs", "loras", "--max-lora-rank", "128", "--openai-port", str(port)
    )
    store = parse_config(AdapterStoreConfig, service_flags(processes["adapter_store"]), environ={})
    assert store.max_rank == 128
    # Every store replica reads the gateways' tenants file: the limits on what tenants store.
    stores = [parse_config(AdapterStoreConfig, service_flags(p), environ={}) for p in processes.values() if p.module == "adapter_store"]  # fmt: skip
    assert [s.tenants_file for s in stores] == [str(tmp_path / "keys.json")] * 2
    gateways = {
        name: parse_config(GatewayConfig, service_flags(p), environ={})
        for name, p in processes.items()
        if p.module == "gateway"
    }
    # Absolute: a service's working directory need not be the one `up` was typed in.
    assert [g.adapter_load_dirs for g in gateways.values()] == [str(tmp_path / "loras")] * 2
    assert gateways["gateway"].openai_port == port and gateways["gateway-1"].openai_port != port
    assert openai_addresses["gateway"] == f"127.0.0.1:{port}"


def test_up_grants_the_store_the_sources_its_lora_modules_import(tmp_path, monkeypatch):
    """A --lora-modules URI is imported by the store, so up's import policy grants it to the
    module's owner (and admin file:// under --adapter-load-dirs); nothing else is granted, and an
    operator's --import-policy-file is passed as it is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loras").mkdir()
    adapter_dir(tmp_path / "local")
    processes, _ = processes_of(
        tmp_path, "--adapter-load-dirs", "loras",
        "--lora-modules", "a=hf://org/repo@v1", "b=s3://bucket/team/b", "c=local",
    )  # fmt: skip
    store = parse_config(AdapterStoreConfig, service_flags(processes["adapter_store"]), environ={})
    assert json.loads(Path(store.import_policy_file).read_text()) == {
        "tenants": {"admin": ["hf://org/repo@v1", "s3://bucket/team/b", (tmp_path / "loras").as_uri()]}
    }
    mine = tmp_path / "policy.json"
    mine.write_text('{"tenants": {}}')
    processes, _ = processes_of(tmp_path, "--import-policy-file", "policy.json")
    store = parse_config(AdapterStoreConfig, service_flags(processes["adapter_store"]), environ={})
    assert store.import_policy_file == str(mine)


def test_without_the_flags_the_services_keep_their_defaults(tmp_path):
    processes, _ = processes_of(tmp_path)
    assert (
        parse_config(AdapterStoreConfig, service_flags(processes["adapter_store"]), environ={}).max_rank == 64
    )
    gateway = parse_config(GatewayConfig, service_flags(processes["gateway"]), environ={})
    assert gateway.adapter_load_dirs == "" and gateway.openai_port != 0  # a free port, picked by up


def blob_settings(settings) -> tuple:
    """The store's blob settings in a config or in `up`'s parsed arguments."""
    return (
        settings.blob_store,
        settings.blob_cache_mib,
        settings.collect_interval_s,
        settings.collect_grace_s,
    )


def test_the_store_keeps_its_catalog_in_ups_etcd_and_its_blobs_where_told(tmp_path):
    """The store's catalog is in etcd (it does not start without one): `up` gives it its own. Its
    blobs are in ``<state dir>/adapter_store`` (``sha256/<sha256>``, where a one-store mesh has
    always kept them) unless ``--blob-store`` names a directory or a bucket; the blob settings
    reach the store alone."""
    processes, _ = processes_of(tmp_path, "--adapter-stores", "1")
    store = parse_config(AdapterStoreConfig, service_flags(processes["adapter_store"]), environ={})
    assert store.etcd_endpoints == "127.0.0.1:2379"
    assert (store.data_dir, store.blob_store) == (str(tmp_path / "adapter_store"),) * 2
    assert blob_settings(store)[1:] == blob_settings(AdapterStoreConfig)[1:]
    flags = ("--blob-store", "s3://loras/mesh-a", "--blob-cache-mib", "64",
             "--collect-interval-s", "30", "--collect-grace-s", "120")  # fmt: skip
    processes, _ = processes_of(tmp_path, *flags)
    store = parse_config(AdapterStoreConfig, service_flags(processes["adapter_store"]), environ={})
    assert store.data_dir == str(tmp_path / "adapter_store")  # the disk cache in front of the bucket
    assert blob_settings(store) == ("s3://loras/mesh-a", 64, 30.0, 120.0)
    for process in processes.values():
        if process.module != "adapter_store":
            assert not {"--blob-store", "--blob-cache-mib", "--collect-grace-s"} & set(service_flags(process))
    argv = detached_argv(up_args(tmp_path, *flags), tmp_path / "state")
    again = build_parser().parse_args(argv[argv.index("--state-dir") :])
    assert blob_settings(again) == ("s3://loras/mesh-a", 64, 30.0, 120.0)


def store_configs(processes) -> dict[str, AdapterStoreConfig]:
    return {
        name: parse_config(AdapterStoreConfig, service_flags(p), environ={})
        for name, p in processes.items()
        if p.module == "adapter_store"
    }


def store_addresses(processes) -> dict[str, str]:
    """The ``--adapter-store`` each gateway and worker is given ("": found in etcd)."""
    return {
        name: parse_config(GatewayConfig if p.module == "gateway" else WorkerConfig, service_flags(p), environ={}).adapter_store
        for name, p in processes.items()
        if p.module in ("gateway", "gpu_worker")
    }  # fmt: skip


def test_up_runs_two_store_replicas_sharing_one_blob_directory_found_in_etcd(tmp_path):
    """By default two store replicas, named as the other replicas are, each with its own data
    directory and all with the same blob directory (and the same catalog, in up's etcd): any of
    them serves any adapter, so the gateways and workers are pinned to none and find the live
    ones in etcd."""
    processes, _ = processes_of(tmp_path)
    stores = store_configs(processes)
    assert list(processes)[:2] == list(stores) == ["adapter_store", "adapter_store-1"]
    assert [s.data_dir for s in stores.values()] == [
        str(tmp_path / "adapter_store"),
        str(tmp_path / "adapter_store-1"),
    ]
    assert {s.blob_store for s in stores.values()} == {str(tmp_path / "adapter_store")}
    assert {s.etcd_endpoints for s in stores.values()} == {"127.0.0.1:2379"}
    assert len({p.address for p in processes.values()}) == len(processes)
    assert set(store_addresses(processes).values()) == {""}
    # One replica: its address is given, as before replicas.
    processes, _ = processes_of(tmp_path, "--adapter-stores", "1")
    assert list(store_configs(processes)) == ["adapter_store"]
    assert set(store_addresses(processes).values()) == {processes["adapter_store"].address}


def test_store_replicas_share_the_blob_store_given(tmp_path, monkeypatch):
    """``--blob-store`` reaches every replica, a directory made absolute (a service's working
    directory need not be up's); each replica keeps its own data directory (its disk cache in
    front of a bucket); the replica count survives ``--detach``."""
    monkeypatch.chdir(tmp_path)
    processes, _ = processes_of(tmp_path, "--adapter-stores", "3", "--blob-store", "shared")
    stores = store_configs(processes)
    assert list(stores) == ["adapter_store", "adapter_store-1", "adapter_store-2"]
    assert {s.blob_store for s in stores.values()} == {str(tmp_path / "shared")}
    assert len({s.data_dir for s in stores.values()}) == 3
    processes, _ = processes_of(tmp_path, "--blob-store", "s3://loras/mesh-a", "--blob-cache-mib", "64")
    stores = store_configs(processes)
    assert {(s.blob_store, s.blob_cache_mib) for s in stores.values()} == {("s3://loras/mesh-a", 64)}
    argv = detached_argv(up_args(tmp_path, "--adapter-stores", "3"), tmp_path / "state")
    assert build_parser().parse_args(argv[argv.index("--state-dir") :]).adapter_stores == 3


def test_up_help_shows_the_stores_blob_settings(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("--blob-store", "--blob-cache-mib", "--collect-interval-s", "--collect-grace-s"):
        assert f"{flag} " in help_text, flag
    assert "default <state dir>/adapter_store, shared by every replica" in help_text
    assert "--adapter-stores N adapter store replicas" in help_text
    assert f"default {AdapterStoreConfig.collect_grace_s}]" in help_text


def test_any_other_setting_passes_through_the_environment(tmp_path, monkeypatch):
    """`LORAMESH_MAX_PROMPT_TOKENS=77 loramesh up`: `up` has no flag for it; each gateway starts
    with up's environment, so it runs with 77. A flag `up` passes wins over its variable."""
    monkeypatch.setenv("LORAMESH_MAX_PROMPT_TOKENS", "77")
    monkeypatch.setenv("LORAMESH_MAX_RANK", "16")
    started: list[tuple[list[str], dict[str, str]]] = []

    class RecordingPopen:  # what the supervisor would start, without starting it
        def __init__(self, argv, *, env, **_):
            started.append((argv, env))

    monkeypatch.setattr(process_module.subprocess, "Popen", RecordingPopen)
    processes, _ = processes_of(tmp_path, "--max-lora-rank", "32")
    for name in ("adapter_store", "gateway", "gateway-1"):
        processes[name].start()
    (store_argv, store_env), *gateways = started
    assert parse_config(AdapterStoreConfig, store_argv[3:], environ=store_env).max_rank == 32
    prompt_limits = [
        parse_config(GatewayConfig, argv[3:], environ=env).max_prompt_tokens for argv, env in gateways
    ]
    assert prompt_limits == [77, 77]


def test_detach_passes_them_to_the_background_up_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loras").mkdir()
    adapter_dir(tmp_path / "bot")
    args = up_args(
        tmp_path, "--adapter-load-dirs", "loras", "--lora-modules", "bot=bot", "--max-lora-rank", "8",
        "--openai-port", "8123",
    )  # fmt: skip
    argv = detached_argv(args, tmp_path / "state")
    again = build_parser().parse_args(argv[argv.index("--state-dir") :])
    assert again.adapter_load_dirs == str(tmp_path / "loras")
    assert again.lora_modules == [f"admin/bot={tmp_path / 'bot'}"]
    assert (again.max_lora_rank, again.openai_port) == (8, 8123)


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--lora-modules", "bot=missing"], "--lora-modules bot=missing: adapter directory {cwd}/missing does not exist"),
        (["--lora-modules", "bot=empty"], "--lora-modules bot=empty: adapter directory {cwd}/empty has no adapter_config.json"),
        (["--lora-modules", "bot"], "--lora-modules 'bot': expected NAME=DIR|URI or OWNER/NAME=DIR|URI"),
        (["--lora-modules", "bob/bot=a"], "--lora-modules bob/bot=a: registering for tenant 'bob' needs its plain API key"),
        (["--lora-modules", "a=a", "admin/a=a"], "--lora-modules names admin/a twice"),
        (["--adapter-load-dirs", "nowhere"], "--adapter-load-dirs: {cwd}/nowhere is not a directory"),
        (["--max-lora-rank", "0"], "--max-lora-rank must be at least 1, got 0"),
        (["--openai-port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["--adapter-stores", "0"], "--adapter-stores must be at least 1, got 0"),
        (["--blob-store", "gs://bucket/x"], "--blob-store 'gs://bucket/x': expected a directory, file:///path or s3://bucket/prefix"),
        (["--blob-cache-mib", "-1"], "--blob-cache-mib must be 0 or more, got -1"),
        (["--collect-interval-s", "0"], "--collect-interval-s must be more than 0, got 0.0"),
        (["--collect-grace-s", "-5"], "--collect-grace-s must be 0 or more, got -5.0"),
    ],
)  # fmt: skip
def test_up_refuses_a_bad_setting_before_starting_anything(flags, reason, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    adapter_dir(tmp_path / "a")
    assert main(["--state-dir", "state", "up", "--detach", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loramesh: " + reason.format(cwd=tmp_path)) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "state").exists()


def test_up_refuses_a_taken_openai_port(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--state-dir", str(tmp_path / "state"), "up", "--openai-port", str(port)]) == 1
    assert capsys.readouterr().err.startswith(f"loramesh: --port {port}: 127.0.0.1:{port} is taken")
    assert not (tmp_path / "state").exists()


def test_a_tenants_module_needs_its_plain_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    adapter_dir(tmp_path / "a")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"lm-bob": "bob", "sha256:00:11": "carol"}))
    args = up_args(tmp_path, "--api-keys-file", str(keys), "--lora-modules", "bob/a=a")
    assert "bob/a=" + str(tmp_path / "a") in detached_argv(args, tmp_path / "state")
    # A hashed key cannot be presented: carol's module is refused.
    assert (
        main(["--state-dir", "state", "up", "--api-keys-file", str(keys), "--lora-modules", "carol/a=a"]) == 1
    )
    assert "registering for tenant 'carol' needs its plain API key" in capsys.readouterr().err


@pytest.mark.integration
def test_a_service_that_cannot_start_is_one_line(tmp_path):
    """Not a traceback of the supervisor's ServiceStartError: a bad --model stops `up` naming the
    process and its log (after the log's tail, for the diagnosis)."""
    done = subprocess.run(
        [sys.executable, "-m", "loramesh_cli.main",
         "--state-dir", str(tmp_path / "state"), "up", "--model", str(tmp_path / "no-such-model.gguf"),
         "--workers", "1", "--gateways", "1", "--schedulers", "1", "--kv-managers", "1"],
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
    )  # fmt: skip
    last = done.stderr.splitlines()[-1]
    # Both store replicas start at once and both fail: either may be the one named.
    assert done.returncode == 1 and re.match(r"loramesh: adapter_store(-1)? did not start \(log ", last), (
        done.stderr
    )
