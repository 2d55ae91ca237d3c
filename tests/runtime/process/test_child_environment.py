"""A service process gets an allow-list of its parent's environment: cloud credentials reach the
adapter store alone, a client's API key no service, an unknown variable nobody."""

from __future__ import annotations

from services.runtime.process.child_environment import child_environment

PARENT = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONPATH": "/site",
    "VIRTUAL_ENV": "/venv",
    "TMPDIR": "/scratch",
    "OMP_NUM_THREADS": "2",
    "TRITON_INTERPRET": "1",
    "CUDA_VISIBLE_DEVICES": "0",
    "AWS_SECRET_ACCESS_KEY": "s3-secret",
    "AWS_ENDPOINT_URL": "http://minio:9000",
    "HF_TOKEN": "hf-secret",
    "GOOGLE_APPLICATION_CREDENTIALS": "/keys/gcp.json",
    "https_proxy": "http://user:pass@proxy:3128",
    "LORAMESH_API_KEY": "lm-client-key",
    "LORAMESH_MAX_RUNNING": "32",
    "LORAMESH_MAX_RANK": "16",
    "DATABASE_PASSWORD": "unrelated",
}
SYSTEM = {"PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR", "OMP_NUM_THREADS",
          "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES"}  # fmt: skip
CLOUD = {
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL",
    "HF_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "https_proxy",
}


def test_a_worker_and_a_gateway_get_no_credentials_and_only_their_settings():
    for service, setting in (
        ("gpu_worker", "LORAMESH_MAX_RUNNING"),
        ("gateway", "LORAMESH_MAX_PROMPT_TOKENS"),
    ):
        env = child_environment(PARENT, service, {setting})
        assert env.keys() == SYSTEM | ({setting} & PARENT.keys()), service
        assert all(env[name] == PARENT[name] for name in env)


def test_the_adapter_store_alone_gets_the_clouds_credentials_and_proxies():
    env = child_environment(PARENT, "adapter_store", {"LORAMESH_MAX_RANK"})
    assert env.keys() == SYSTEM | CLOUD | {"LORAMESH_MAX_RANK"}
    assert (env["AWS_SECRET_ACCESS_KEY"], env["HF_TOKEN"]) == ("s3-secret", "hf-secret")


def test_without_a_settings_list_every_loramesh_variable_passes():
    """What ServiceProcess does for a caller that names none (tests, benchmarks)."""
    env = child_environment(PARENT, "scheduler")
    assert env.keys() == SYSTEM | {"LORAMESH_API_KEY", "LORAMESH_MAX_RUNNING", "LORAMESH_MAX_RANK"}
