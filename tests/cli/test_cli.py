"""The ``loramesh`` command as a user runs it: a real local mesh, real processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from grpc import aio
from support.cli import loramesh
from support.polling import poll_until
from support.prometheus import running_prometheus

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh_cli.mesh_file import pid_alive
from loramesh_cli.prometheus_targets import TARGETS_FILE_NAME
from mesh_api.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.model_files.peft_format import LORA_TARGETS

pytestmark = pytest.mark.integration


BOB_KEY = "lm-test-bob"
"""A second tenant's key, beside mesh.json's admin key (``up --api-keys-file``)."""
UP_SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "s3-secret",
    "HF_TOKEN": "hf-secret",
    "LORAMESH_API_KEY": "lm-client-key",
}
"""In `up`'s environment: the cloud's credentials, for the adapter store alone, and a client's
own key, for no service."""


@pytest.fixture
def mesh(tmp_path):
    state = tmp_path / "state"
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({BOB_KEY: "bob"}))
    loramesh(
        state, "up", "--detach", "--workers", "2", "--dtype", "float32", "--pool-mib", "64",
        "--migration", "pets", "--prefetch", "burst-tolerance", "--length-predictor", "magnus",
        "--api-keys-file", str(keys_file),
        # The store's collector runs often enough to watch: a blob no adapter names is gone in seconds.
        "--collect-interval-s", "0.5", "--collect-grace-s", "2",
        env=UP_SECRETS,
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
    # What each worker runs, from its load report: --quantization auto keeps the default GGUF's
    # own Q4_1 blocks; the activations are the --dtype given.
    runs = {
        name: entry["runs"] for name, entry in mesh_file["services"].items() if name.startswith("gpu_worker")
    }
    assert runs == dict.fromkeys(
        ("gpu_worker-0", "gpu_worker-1"), "weights q4_1 (quantized blocks), activations float32"
    )
    only_the_store_has_the_credentials(mesh_file)

    directory = write_peft_adapter(
        tmp_path / "a", base_spec, SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS)
    )
    out = loramesh(mesh, "adapters", "upload", str(directory), "--name", "mine").stdout
    assert "registered admin/mine" in out and "rank=16" in out
    # The catalog is in up's etcd; the weights are a blob named by their sha256 in the state directory.
    weights = (directory / "adapter_model.safetensors").read_bytes()
    blob = mesh / "adapter_store" / "sha256" / hashlib.sha256(weights).hexdigest()
    assert blob.read_bytes() == weights
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
    adapters_act_as_the_keys_tenant(mesh, directory, mesh_file)
    a_tenants_file_edit_takes_effect_without_a_restart(mesh_file, tmp_path / "keys.json")
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 999}))
    bad = loramesh(mesh, "adapters", "upload", str(directory), "--name", "bad", check=False)
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr

    status = json.loads(loramesh(mesh, "status", "--json").stdout)
    assert [(r["service"], r["instance"], r["health"], r["restarts"]) for r in status] == [
        ("adapter_store", "adapter_store", "SERVING", 0),
        ("adapter_store", "adapter_store-1", "SERVING", 0),
        ("gateway", "gateway", "SERVING", 0),
        ("gateway", "gateway-1", "SERVING", 0),
        ("gpu_worker", "gpu_worker-0", "SERVING", 0),
        ("gpu_worker", "gpu_worker-1", "SERVING", 0),
        ("kv_manager", "kv_manager", "SERVING", 0),
        ("kv_manager", "kv_manager-1", "SERVING", 0),
        ("scheduler", "scheduler", "SERVING", 0),
        ("scheduler", "scheduler-1", "SERVING", 0),
    ]
    # Two store replicas (up's default), one catalog in etcd and one blob directory between them.
    stores = [r["load"] for r in status if r["service"] == "adapter_store"]
    assert {(load["catalog"], load["blob_store"]) for load in stores} == {
        ("ok", (mesh / "adapter_store").resolve().as_uri())
    }
    assert all(isinstance(load["adapters"], int) for load in stores)
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
    assert f"Adapter stores (2 replicas; blob store {(mesh / 'adapter_store').resolve().as_uri()})" in table
    assert table.split("Adapter stores")[1].splitlines()[1].split() == [
        "STORE",
        "ADDRESS",
        "HEALTH",
        "CATALOG",
        "ADAPTERS",
    ]
    for name in ("gpu_worker-0", "gpu_worker-1"):
        assert asyncio.run(generate_two_tokens(mesh_file["services"][name]["address"])) == 2

    done = loramesh(mesh, "generate", "--max-tokens", "6", "The capital of France is")
    assert " Paris" in done.stdout and "prompt" in done.stderr and "generated tokens" in done.stderr
    done = loramesh(mesh, "chat", "--max-tokens", "8", "--adapter", "mine", "Say hello.")
    assert done.stdout.strip() and "[" in done.stderr
    if shutil.which("prometheus"):  # make setup installs it
        asyncio.run(the_shipped_prometheus_scrapes_the_mesh(mesh, tmp_path))
    refused = loramesh(mesh, "generate", "--adapter", "nobody/none", "hi", check=False)
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr and not refused.stdout

    assert "deleted admin/mine" in loramesh(mesh, "adapters", "delete", "mine").stdout
    gone = loramesh(mesh, "adapters", "delete", "mine", check=False)
    assert gone.returncode != 0 and "NOT_FOUND" in gone.stderr
    # No adapter names those weights any more (admin/shared and bob/mine, the same bytes, went
    # before): the store's collector removes the blob (up's --collect-interval-s, --collect-grace-s).
    # It goes once older than the grace, at the collector's next round: waited for by condition,
    # bounded only by the hang guard.
    asyncio.run(
        poll_until(
            lambda: asyncio.sleep(0, blob.exists()),
            lambda exists: not exists,
            f"{blob} collected after its last adapter was deleted",
            interval_s=0.2,
        )
    )

    second_up = loramesh(mesh, "up", "--detach", check=False)
    assert second_up.returncode != 0 and "already up" in second_up.stderr

    loramesh(mesh, "down")
    assert not (mesh / "mesh.json").exists()
    after = loramesh(mesh, "status", check=False)
    assert after.returncode != 0 and "no mesh is up" in after.stderr


def a_tenants_file_edit_takes_effect_without_a_restart(mesh_file, keys_file: Path) -> None:
    """`up --api-keys-file FILE`: a key added to FILE lets its tenant in, with no restart (up keeps
    the gateways' hashed copy in step; the gateways reload it)."""
    models = f"http://{mesh_file['services']['gateway']['openai_address']}/v1/models"
    carol = {"Authorization": "Bearer lm-test-carol"}

    async def status() -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            return (await http.get(models, headers=carol)).status_code

    assert asyncio.run(status()) == 401
    keys_file.write_text(json.dumps({BOB_KEY: "bob", "lm-test-carol": "carol"}))
    asyncio.run(poll_until(status, lambda code: code == 200, "a key added to the tenants file is accepted"))


async def the_shipped_prometheus_scrapes_the_mesh(mesh: Path, tmp_path: Path) -> None:
    """monitoring/prometheus-up.yml over up's targets file: after the chat on ``mine`` and the
    base model's generate, the gateways' vLLM-named series have counts per adapter."""
    work_dir = tmp_path / "prometheus"
    work_dir.mkdir()
    async with running_prometheus(mesh, work_dir) as (_, query):
        ttft = await poll_until(
            lambda: query("sum by (adapter) (vllm:time_to_first_token_seconds_count)"),
            lambda got: got.get("admin/mine", 0) >= 1 and got.get("", 0) >= 1,
            "Prometheus has the mesh's TTFT counts per adapter",
            interval_s=0.5,
        )
        tokens = await query("sum by (adapter) (vllm:generation_tokens_total)")
        assert tokens.get("admin/mine", 0) >= 1 and tokens.get("", 0) >= 1, (ttft, tokens)
        groups = json.loads((mesh / TARGETS_FILE_NAME).read_text())
        targets = sum(len(group["targets"]) for group in groups)
        assert targets == 11  # etcd and the ten processes
        await poll_until(
            lambda: query("count(up == 1)"),
            lambda got: got == {"": float(targets)},
            "Prometheus scrapes every process of the mesh and etcd",
            interval_s=0.5,
        )


def adapters_act_as_the_keys_tenant(mesh, directory, mesh_file) -> None:
    """`loramesh adapters` goes through the gateway: the key's tenant owns what it uploads, and a
    tenant sees and deletes only its own adapters (and sees public ones)."""

    def names(listing: str) -> set[tuple[str, str, str]]:
        rows = [line.split() for line in listing.splitlines()[1:]]
        return {(row[0], row[1], row[6]) for row in rows}

    out = loramesh(mesh, "adapters", "upload", str(directory), "--name", "shared", "--public").stdout
    assert out.startswith("registered admin/shared id=") and out.strip().endswith(" public")
    as_bob = ("--api-key", BOB_KEY)
    assert names(loramesh(mesh, "adapters", "list", *as_bob).stdout) == {("shared", "admin", "public")}
    for name, code in (("mine", "NOT_FOUND"), ("admin/mine", "PERMISSION_DENIED")):
        refused = loramesh(mesh, "adapters", "delete", name, *as_bob, check=False)
        assert refused.returncode == 1 and code in refused.stderr and not refused.stdout, refused.stderr
    # The key from $LORAMESH_API_KEY, the flags before the verb: bob's own "mine", beside admin's.
    bob_env = {"LORAMESH_API_KEY": BOB_KEY}
    out = loramesh(mesh, "adapters", "upload", str(directory), "--name", "mine", env=bob_env).stdout
    assert out.startswith("registered bob/mine ") and "rank=16" in out
    gateway = mesh_file["gateway_addresses"][-1]
    listing = loramesh(mesh, "adapters", "--gateway", gateway, "--api-key", BOB_KEY, "list").stdout
    assert names(listing) == {("mine", "bob", "private"), ("shared", "admin", "public")}
    assert names(loramesh(mesh, "adapters", "list").stdout) == {
        ("mine", "admin", "private"),
        ("shared", "admin", "public"),
    }
    assert "deleted bob/mine" in loramesh(mesh, "adapters", "delete", "mine", env=bob_env).stdout
    assert "deleted admin/shared" in loramesh(mesh, "adapters", "delete", "shared").stdout
    # mesh.json's admin key goes only to that mesh's gateways; a wrong key is refused by the gateway.
    elsewhere = loramesh(mesh, "adapters", "list", "--gateway", "127.0.0.1:1", check=False)
    assert elsewhere.returncode == 1 and "no API key" in elsewhere.stderr
    wrong = loramesh(mesh, "adapters", "list", "--api-key", "lm-wrong", check=False)
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr


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


def test_adapters_has_no_way_to_name_another_owner(tmp_path):
    """The former flags (the adapter store directly, any owner without its key) are refused,
    saying what to do instead; a gateway not in mesh.json gets no key but the caller's."""
    for argv, instead in (
        (["adapters", "--owner", "bob", "upload", str(tmp_path), "--name", "x"], "--api-key"),
        (["adapters", "--store", "127.0.0.1:50051", "list"], "--gateway"),
        (["adapters", "list", "--all-owners"], "public"),
    ):
        done = loramesh(tmp_path, *argv, check=False)
        assert done.returncode == 2 and "was removed" in done.stderr and instead in done.stderr
    done = loramesh(tmp_path, "adapters", "delete", "x", "--gateway", "127.0.0.1:1", check=False)
    assert done.returncode == 1 and "no API key" in done.stderr and "--api-key" in done.stderr


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def only_the_store_has_the_credentials(mesh_file: dict) -> None:
    """Each running service's own environment, as the kernel holds it: `up`'s cloud credentials
    reached the store replicas alone, and the client's key none."""
    for name, entry in mesh_file["services"].items():
        env = environment_of(entry["pid"])
        assert "PATH" in env and "LORAMESH_API_KEY" not in env, name
        credentials = {key: env.get(key) for key in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN")}
        expected = ("s3-secret", "hf-secret") if name.startswith("adapter_store") else (None, None)
        assert tuple(credentials.values()) == expected, name


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
    """The issue's reproduction: `up` in the foreground from a parent that never calls wait().
    With ``--kv-managers 0``, as documented: no DistKV, the worker preempting."""
    state = tmp_path / "state"
    up = subprocess.Popen(
        [sys.executable, "-m", "loramesh_cli.main", "--state-dir", str(state),
         "up", "--workers", "1", "--dtype", "float32", "--pool-mib", "64", "--kv-managers", "0"],
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
        services = json.loads(mesh_json.read_text())["services"]
        assert not any(name.startswith("kv_manager") for name in services)
        worker = Path(f"/proc/{services['gpu_worker-0']['pid']}/cmdline").read_bytes().split(b"\0")
        assert worker[worker.index(b"--kv-overflow") + 1] == b"preempt"
        store = state / "adapter_store"
        for directory in (state, state / "logs", state / "etcd", store, store / "sha256", store / "staging"):
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
