"""vLLM's flag names on `loramesh up`: each is accepted, has the effect docs/cli.md states (read
back the way each service reads its command line), and has its row in docs/cli.md."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from loramesh_cli.lora_capacity import adapter_mib
from loramesh_cli.lora_modules import parse_lora_modules
from loramesh_cli.main import build_parser, main
from loramesh_cli.mesh_layout import service_processes
from loramesh_cli.up_arguments import admin_key, detached_argv
from services.adapter_store.config import AdapterStoreConfig
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import WorkerConfig
from services.model_files.base_model import load_base_model_spec
from services.runtime.config import parse_config
from services.runtime.process.ports import free_port
from tests.cli.test_up_settings import adapter_dir, service_flags

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
VLLM_FLAGS = (
    "--host", "--port", "--api-key", "--served-model-name", "--max-model-len",
    "--max-lora-rank", "--lora-modules", "--max-loras", "--max-cpu-loras",
)  # fmt: skip
"""The vLLM flags issue 51 names, each a flag of `up` under vLLM's spelling."""


def up_args(tmp_path, *flags: str):
    return build_parser().parse_args(["--state-dir", str(tmp_path / "state"), "up", *flags])


def configs(tmp_path, *flags: str) -> dict[str, list]:
    """Each kind's configs as its processes parse their command lines, and the processes."""
    processes, _ = service_processes(up_args(tmp_path, *flags), tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "k.json", None)  # fmt: skip
    kinds = {"gpu_worker": WorkerConfig, "gateway": GatewayConfig, "adapter_store": AdapterStoreConfig}
    found: dict[str, list] = {"processes": list(processes.values())}
    for process in processes.values():
        if process.module in kinds:
            found.setdefault(process.module, []).append(
                parse_config(kinds[process.module], service_flags(process), environ={})
            )
    return found


def test_every_vllm_flag_is_a_flag_of_up_and_a_row_of_the_doc():
    (up,) = [a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "up" in a.choices]
    options = {option for action in up.choices["up"]._actions for option in action.option_strings}
    text = CLI_DOC.read_text(encoding="utf-8")
    vllm_table = text[text.index("## vLLM's flag names") : text.index("## A config file")]
    for flag in VLLM_FLAGS:
        assert flag in options, flag
        assert re.search(rf"^\| `{flag}[ `]", vllm_table, re.MULTILINE), (
            f"docs/cli.md's vLLM table has no {flag}"
        )
        assert re.search(rf"^\| `{flag}[ `,]", text, re.MULTILINE), f"docs/cli.md's `up` table has no {flag}"


def test_host_and_port_place_the_gateways(tmp_path):
    port = free_port()
    found = configs(tmp_path, "--host", "0.0.0.0", "--port", str(port))
    hosts = {p.module: p.host for p in found["processes"]}
    assert hosts["gateway"] == "0.0.0.0" and hosts["gpu_worker"] == hosts["scheduler"] == "127.0.0.1"
    assert [g.host for g in found["gateway"]] == ["0.0.0.0", "0.0.0.0"]
    assert found["gateway"][0].openai_port == port and found["gateway"][1].openai_port != port
    assert up_args(tmp_path, "--openai-port", str(port)).openai_port == port  # loramesh's spelling


def test_api_key_is_the_admin_key(tmp_path):
    assert admin_key(up_args(tmp_path, "--api-key", "sk-mine")) == "sk-mine"
    assert admin_key(up_args(tmp_path)).startswith("lm-admin-")
    argv = detached_argv(up_args(tmp_path, "--api-key", "sk-mine"), tmp_path)
    assert argv[argv.index("--api-key") + 1] == "sk-mine"


def test_served_model_name_and_max_model_len_reach_every_gateway(tmp_path):
    found = configs(tmp_path, "--served-model-name", "smol", "--max-model-len", "512")
    assert [(g.served_model_name, g.max_model_len) for g in found["gateway"]] == [("smol", 512)] * 2
    assert [(g.served_model_name, g.max_model_len) for g in configs(tmp_path)["gateway"]] == [("", 0)] * 2


def test_max_lora_rank_is_the_stores_max_rank(tmp_path):
    assert [s.max_rank for s in configs(tmp_path, "--max-lora-rank", "16")["adapter_store"]] == [16, 16]


def test_max_loras_adds_room_for_adapters_to_the_pool(tmp_path):
    one = adapter_mib(load_base_model_spec(None), AdapterStoreConfig.max_rank)
    assert 70 < one < 80  # SmolLM2-135M at rank 64, fp32, every projection: docs/cli.md's 74.5 MiB
    assert [w.pool_mib for w in configs(tmp_path, "--max-loras", "2")["gpu_worker"]] == [
        512 + math.ceil(2 * one)
    ]
    at_rank_8 = adapter_mib(load_base_model_spec(None), 8)
    workers = configs(tmp_path, "--max-loras", "4", "--max-lora-rank", "8", "--pool-mib", "256")["gpu_worker"]
    assert [w.pool_mib for w in workers] == [256 + math.ceil(4 * at_rank_8)]


def test_max_cpu_loras_sizes_the_host_cache(tmp_path):
    one = adapter_mib(load_base_model_spec(None), AdapterStoreConfig.max_rank)
    assert [w.host_cache_mib for w in configs(tmp_path, "--max-cpu-loras", "3")["gpu_worker"]] == [
        math.ceil(3 * one)
    ]
    assert [w.host_cache_mib for w in configs(tmp_path)["gpu_worker"]] == [WorkerConfig.host_cache_mib]
    argv = detached_argv(up_args(tmp_path, "--max-cpu-loras", "3", "--max-loras", "2"), tmp_path)
    again = build_parser().parse_args(argv[argv.index("--state-dir") :])
    assert (again.max_cpu_loras, again.max_loras) == (3, 2)


def test_lora_modules_in_vllms_json_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    adapter_dir(tmp_path / "pirate")
    adapter_dir(tmp_path / "sql")
    entry = json.dumps({"name": "sql", "path": "sql", "base_model_name": "SmolLM2-135M-Instruct"})
    modules = parse_lora_modules(["pirate=pirate", entry], "admin", {})
    assert [(m.owner, m.name, m.source) for m in modules] == [
        ("admin", "pirate", str(tmp_path / "pirate")),
        ("admin", "sql", str(tmp_path / "sql")),
    ]
    argv = detached_argv(up_args(tmp_path, "--lora-modules", entry), tmp_path)
    assert f"admin/sql={tmp_path / 'sql'}" in argv


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--lora-modules", '{"name": "x"'], "--lora-modules '{\"name\": \"x\"': not JSON"),
        (["--lora-modules", '{"name": "x", "path": "p", "rank": 8}'], "expected a JSON object of base_model_name, name, path"),
        (["--lora-modules", '{"name": 1, "path": "p"}'], "each of base_model_name, name, path must be a string"),
        (["--max-loras", "0"], "--max-loras must be at least 1, got 0"),
        (["--max-cpu-loras", "2", "--host-cache-mib", "64"], "give it or --host-cache-mib, not both"),
        (["--host", "example.com"], "--host 'example.com': expected an IPv4 address"),
        (["--host", "0.0.0.0", "--tls"], "--host 0.0.0.0 with --tls: the mesh's certificates name 127.0.0.1"),
        (["--api-key", " k"], "--api-key: a key is printable text without surrounding spaces"),
    ],
)  # fmt: skip
def test_refusals_name_the_flag(tmp_path, capsys, flags, reason):
    assert main(["--state-dir", str(tmp_path / "state"), "up", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loramesh: ") and reason in err, err
    assert not (tmp_path / "state" / "mesh.json").exists()
