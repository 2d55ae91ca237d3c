"""The etcd that ``loramesh up`` (and every fixture) starts gets the system's variables alone:
no cloud credentials, no client API key, no ``LORAMESH_*`` settings (read back from the running
process's /proc/<pid>/environ)."""

from __future__ import annotations

from services.runtime.etcd.etcd_server import EtcdServer, etcd_environment

OPERATOR_ENVIRONMENT = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "AWS_SECRET_ACCESS_KEY": "s3-secret",
    "HF_TOKEN": "hf-secret",
    "LORAMESH_API_KEY": "lm-key",
    "ETCD_UNSUPPORTED_ARCH": "riscv64",
    "ETCD_DATA_DIR": "/elsewhere",
}


def test_etcd_gets_the_system_variables_and_its_platform_switch_only():
    assert etcd_environment(OPERATOR_ENVIRONMENT) == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "ETCD_UNSUPPORTED_ARCH": "riscv64",
    }


def test_a_running_etcd_holds_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3-secret")
    monkeypatch.setenv("LORAMESH_API_KEY", "lm-key")
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        with open(f"/proc/{server.pid}/environ", "rb") as environ:
            names = {entry.split(b"=", 1)[0].decode() for entry in environ.read().split(b"\0") if entry}
    finally:
        server.stop()
    assert "PATH" in names
    assert not names & {"AWS_SECRET_ACCESS_KEY", "LORAMESH_API_KEY"}
