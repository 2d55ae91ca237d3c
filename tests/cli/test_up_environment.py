"""Each process `loramesh up` starts gets the part of `up`'s environment its service needs: its
own ``LORAMESH_*`` settings, and the cloud's credentials for the adapter store alone (a real
`up` is checked in tests/cli/test_cli.py, reading each process's /proc/<pid>/environ)."""

from __future__ import annotations

from loramesh_cli.main import build_parser
from loramesh_cli.mesh_layout import service_processes
from services.runtime.process.child_environment import child_environment

UP_ENVIRONMENT = {
    "PATH": "/usr/bin",
    "AWS_SECRET_ACCESS_KEY": "s3-secret",
    "HF_TOKEN": "hf-secret",
    "LORAMESH_API_KEY": "lm-the-operators-own-key",
    "LORAMESH_MAX_RUNNING": "32",
    "LORAMESH_MAX_RANK": "16",
    "LORAMESH_MAX_PROMPT_TOKENS": "8192",
    "LORAMESH_DGFM_INTERVAL_S": "5",
    "LORAMESH_CACHE_DIR": "/cache",
}


def test_each_process_gets_its_own_settings_and_only_the_store_gets_credentials(tmp_path):
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", "--workers", "2"])
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None)
    own = {
        "adapter_store": {"AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "LORAMESH_MAX_RANK"},
        "gpu_worker": {"LORAMESH_MAX_RUNNING"},
        "gateway": {"LORAMESH_MAX_PROMPT_TOKENS"},
        "kv_manager": {"LORAMESH_DGFM_INTERVAL_S"},
        "scheduler": set(),
    }
    assert {p.module for p in processes.values()} == own.keys()
    for name, process in processes.items():
        env = child_environment(UP_ENVIRONMENT, process.module, process.settings)
        assert env.keys() == {"PATH", "LORAMESH_CACHE_DIR"} | own[process.module], name
