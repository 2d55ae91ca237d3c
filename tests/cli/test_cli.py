"""The ``loramesh`` command as a user runs it: a real local mesh, real processes."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time

import httpx
import pytest
from grpc import aio
from support.cli import loramesh

from loramesh_cli.mesh_file import pid_alive
from loramesh_cli.sample_adapters import SampleAdapterSpec, write_peft_adapter
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.runtime.base_model import LORA_TARGETS

pytestmark = pytest.mark.integration


@pytest.fixture
def mesh(tmp_path):
    state = tmp_path / "state"
    loramesh(
        state, "up", "--detach", "--workers", "2", "--dtype", "float32", "--pool-mib", "64",
        "--migration", "pets", "--prefetch", "burst-tolerance", "--length-predictor", "magnus",
    )  # fmt: skip
    yield state
    loramesh(state, "down", check=False)


def test_up_adapters_status_down(mesh, tmp_path, base_spec):
    mesh_file = json.loads((mesh / "mesh.json").read_text())
    assert mesh_file["ready"] and "adapter_store" in mesh_file["services"] and mesh_file["admin_api_key"]
    # The gateways get the keys hashed, in an owner-only file: the admin key is only in mesh.json.
    keys_file = mesh / "gateway-api-keys.json"
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    assert mesh_file["admin_api_key"] not in keys_file.read_text() and "sha256:" in keys_file.read_text()
    assert mesh_file["tls"] == {}  # plaintext unless `up --tls`

    directory = write_peft_adapter(
        tmp_path / "a", base_spec, SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS)
    )
    out = loramesh(mesh, "adapters", "upload", str(directory), "--name", "mine").stdout
    assert "registered admin/mine" in out and "rank=16" in out
    listing = loramesh(mesh, "adapters", "list").stdout.splitlines()
    assert listing[0].split()[:3] == ["NAME", "OWNER", "RANK"] and listing[1].split()[:3] == [
        "mine",
        "admin",
        "16",
    ]

    # The gateway's OpenAI API is in mesh.json beside its other addresses, for the same admin key.
    openai_url = f"http://{mesh_file['services']['gateway']['openai_address']}/v1/models"
    auth = {"Authorization": f"Bearer {mesh_file['admin_api_key']}"}
    assert "mine" in {m["id"] for m in httpx.get(openai_url, headers=auth, timeout=60).json()["data"]}

    again = loramesh(mesh, "adapters", "upload", str(directory), "--name", "mine", check=False)
    assert again.returncode != 0 and "ALREADY_EXISTS" in again.stderr and "mine" in again.stderr
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 999}))
    bad = loramesh(mesh, "adapters", "upload", str(directory), "--name", "bad", check=False)
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr

    status = json.loads(loramesh(mesh, "status", "--json").stdout)
    assert [(r["service"], r["instance"], r["health"], r["restarts"]) for r in status] == [
        ("adapter_store", "adapter_store", "SERVING", 0),
        ("gateway", "gateway", "SERVING", 0),
        ("gateway", "gateway-1", "SERVING", 0),
        ("gpu_worker", "gpu_worker-0", "SERVING", 0),
        ("gpu_worker", "gpu_worker-1", "SERVING", 0),
        ("kv_manager", "kv_manager", "SERVING", 0),
        ("kv_manager", "kv_manager-1", "SERVING", 0),
        ("scheduler", "scheduler", "SERVING", 0),
        ("scheduler", "scheduler-1", "SERVING", 0),
    ]
    # What the schedulers did beyond placing: migrations, prefetches, the predictor's error.
    for row in (r for r in status if r["service"] == "scheduler"):
        assert {"migrations", "prefetches", "rebalance_rounds", "predictor_mae_tokens"} <= set(row["load"])
    assert "predictor_mae_tokens=" in loramesh(mesh, "status").stdout
    assert mesh_file["gateway_addresses"] == [
        mesh_file["services"][name]["address"] for name in ("gateway", "gateway-1")
    ]
    table = loramesh(mesh, "status").stdout
    assert table.splitlines()[0].split() == ["PROCESS", "PID", "RESTARTS", "LAST", "EXIT"]
    assert "etcd" in table and "gateway-1" in table
    for name in ("gpu_worker-0", "gpu_worker-1"):
        assert asyncio.run(generate_two_tokens(mesh_file["services"][name]["address"])) == 2

    done = loramesh(mesh, "generate", "--max-tokens", "6", "The capital of France is")
    assert " Paris" in done.stdout and "prompt" in done.stderr and "generated tokens" in done.stderr
    done = loramesh(mesh, "chat", "--max-tokens", "8", "--adapter", "mine", "Say hello.")
    assert done.stdout.strip() and "[" in done.stderr
    refused = loramesh(mesh, "generate", "--adapter", "nobody/none", "hi", check=False)
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr and not refused.stdout

    assert "deleted admin/mine" in loramesh(mesh, "adapters", "delete", "mine").stdout
    gone = loramesh(mesh, "adapters", "delete", "mine", check=False)
    assert gone.returncode != 0 and "NOT_FOUND" in gone.stderr

    second_up = loramesh(mesh, "up", "--detach", check=False)
    assert second_up.returncode != 0 and "already up" in second_up.stderr

    loramesh(mesh, "down")
    assert not (mesh / "mesh.json").exists()
    after = loramesh(mesh, "status", check=False)
    assert after.returncode != 0 and "no mesh is up" in after.stderr


async def generate_two_tokens(address: str) -> int:
    async with aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling=types_pb2.SamplingParams(max_tokens=2)
        )
        return sum([len(reply.token_ids) async for reply in stub.Generate(request, timeout=120)])


def test_commands_without_a_mesh_say_so(tmp_path):
    for argv in (["down"], ["adapters", "list"]):
        done = loramesh(tmp_path, *argv, check=False)
        assert done.returncode == 1 and "no mesh is up" in done.stderr


def test_a_zombie_counts_as_gone():
    child = subprocess.Popen(["true"])
    # Wait for the exit without reaping it: the child stays a zombie, as under a parent that never waits.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert not pid_alive(child.pid)
        assert pid_alive(os.getpid())
    finally:
        child.wait()
    assert not pid_alive(child.pid)


def test_down_returns_when_up_exited_but_was_never_reaped_and_state_is_owner_only(tmp_path):
    """The issue's reproduction: `up` in the foreground from a parent that never calls wait()."""
    state = tmp_path / "state"
    up = subprocess.Popen(
        [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state),
         "up", "--workers", "1", "--dtype", "float32", "--pool-mib", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        mesh_json = state / "mesh.json"
        while not (mesh_json.exists() and json.loads(mesh_json.read_text())["ready"]):
            # waitid with WNOHANG|WNOWAIT looks without reaping: `up` must stay this test's unreaped child.
            assert os.waitid(os.P_PID, up.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None, "up exited"
            time.sleep(0.2)

        def mode(path):
            return stat.S_IMODE(path.stat().st_mode)

        assert mode(mesh_json) == 0o600  # it holds the admin API key
        for directory in (state, state / "logs", state / "etcd", state / "adapter_store"):
            assert mode(directory) == 0o700, directory

        started = time.monotonic()
        down = subprocess.run(
            [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state), "down"],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        print(f"`loramesh down` returned in {time.monotonic() - started:.2f} s")
        assert down.returncode == 0 and "mesh stopped" in down.stderr, down.stderr
        assert not mesh_json.exists()
        assert os.waitid(os.P_PID, up.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None  # a zombie now
    finally:
        if up.poll() is None:
            up.kill()
        up.wait()
