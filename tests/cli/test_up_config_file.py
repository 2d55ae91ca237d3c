"""`loramesh up --config FILE`: a TOML or YAML file of up's flags gives the same parsed arguments
and the same services as the flags themselves, and the command line wins over it; a key that is
no flag, or a value a flag would refuse, is refused in one line naming the file and the key."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from loramesh_cli.config_file import with_config_file
from loramesh_cli.main import build_parser, main, subcommand
from loramesh_cli.mesh_layout import service_processes
from loramesh_cli.up_arguments import detached_argv
from tests.cli.test_up_settings import adapter_dir, service_flags

FLAGS = [
    "--workers", "2", "--model", "", "--dtype", "float32", "--pool-mib", "256",
    "--served-model-name", "smol", "--port", "0", "--api-key", "sk-test",
    "--lora-modules", "pirate=pirate", '{"name": "sql", "path": "sql"}',
    "--prefix-cache", "off", "--deterministic", "on", "--detach", "--kv-managers", "0",
    "--batch-policy", "lcfs", "--max-loras", "2",
]  # fmt: skip
TABLE = {
    "workers": 2, "model": "", "dtype": "float32", "pool_mib": 256,
    "served-model-name": "smol", "port": 0, "api_key": "sk-test",
    "lora-modules": ["pirate=pirate", {"name": "sql", "path": "sql"}],
    "prefix-cache": False, "deterministic": True, "detach": True, "kv_managers": 0,
    "batch-policy": "lcfs", "max-loras": 2,
}  # fmt: skip
"""The same settings as :data:`FLAGS`, with dashes and underscores, switches as booleans and a
--lora-modules entry as a table (vLLM's JSON form)."""
TOML = """\
workers = 2
model = ""
dtype = "float32"
pool_mib = 256
served-model-name = "smol"
port = 0
api_key = "sk-test"
lora-modules = ["pirate=pirate", { name = "sql", path = "sql" }]
prefix-cache = false
deterministic = true
detach = true
kv_managers = 0
batch-policy = "lcfs"
max-loras = 2
"""


def parse(tmp_path, *argv: str) -> argparse.Namespace:
    """`loramesh up ARGV` parsed as main parses it, with its --config file applied."""
    full = ["--state-dir", str(tmp_path / "state"), "up", *argv]
    parser = build_parser()
    args = parser.parse_args(full)
    return with_config_file(parser, subcommand(parser, "up"), full, args.config) if args.config else args


def layout(tmp_path, args) -> dict[str, list[str]]:
    """Each service process's flags, the ports up picks free (new for each layout) as PORT."""
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "k.json", None)
    flags = {}
    for name, process in processes.items():
        tokens = service_flags(process)
        flags[name] = [
            "PORT" if i and tokens[i - 1] in ("--port", "--http-port", "--openai-port") else token
            for i, token in enumerate(tokens)
        ]
    return flags


@pytest.fixture
def adapters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    adapter_dir(tmp_path / "pirate")
    adapter_dir(tmp_path / "sql")


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".yml"])
def test_a_file_gives_what_the_flags_give(tmp_path, adapters, suffix):
    path = tmp_path / f"mesh{suffix}"
    path.write_text(TOML if suffix == ".toml" else yaml.safe_dump(TABLE))
    from_flags, from_file = parse(tmp_path, *FLAGS), parse(tmp_path, "--config", str(path))
    assert {**vars(from_file), "config": ""} == vars(from_flags)
    assert layout(tmp_path, from_file) == layout(tmp_path, from_flags)
    # The background `up` of --detach gets the settings themselves, not the file.
    assert detached_argv(from_file, tmp_path / "state") == detached_argv(from_flags, tmp_path / "state")


def test_the_command_line_wins_over_the_file(tmp_path, adapters):
    path = tmp_path / "mesh.toml"
    path.write_text(TOML)
    args = parse(
        tmp_path, "--workers", "1", "--config", str(path), "--lora-modules", "only=pirate", "--prefix-cache"
    )
    assert (args.workers, args.lora_modules, args.prefix_cache) == (1, ["only=pirate"], "on")
    assert (args.pool_mib, args.served_model_name, args.detach) == (256, "smol", True)  # the file's


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("wrokers = 2", "'wrokers' is not a flag of `loramesh up`"),
        ("config = 'other.toml'", "'config' is not a flag of `loramesh up`"),
        ("workers = 'two'", "argument --workers: invalid int value: 'two'"),
        ("dtype = 'float8'", "argument --dtype: invalid choice: 'float8'"),
        ("detach = 'yes'", "'detach' is a switch: true or false, got 'yes'"),
        ("workers = true", "'workers' takes a value, not true"),
        ("workers = [1, 2]", "'workers' takes one value, got [1, 2]"),
        ("workers = 2\nworkers-x = 1\n[x", "--config"),
        ("port = 1\nopenai-port = 2", "'openai-port' sets --openai-port again"),
    ],
)
def test_a_bad_file_is_refused_naming_the_key(tmp_path, capsys, text, reason):
    path = tmp_path / "mesh.toml"
    path.write_text(text)
    assert main(["--state-dir", str(tmp_path / "state"), "up", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"loramesh: --config {path}: ") and reason in err, err


def test_a_missing_file_and_an_unknown_suffix_are_refused(tmp_path, capsys):
    assert main(["up", "--config", str(tmp_path / "absent.toml")]) == 1
    assert "No such file" in capsys.readouterr().err
    (tmp_path / "mesh.json").write_text(json.dumps({"workers": 2}))
    assert main(["up", "--config", str(tmp_path / "mesh.json")]) == 1
    assert "expected a .toml, .yaml or .yml file" in capsys.readouterr().err
