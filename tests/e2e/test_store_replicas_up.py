"""Adapter store replicas in a real ``loramesh up`` mesh (issue 48): one replica can die while
adapters are uploaded and served, and nothing a client sees changes.

One supervised mesh (two store replicas sharing the catalog in etcd and one blob directory; one
gateway, scheduler, kv_manager and worker, float32, mutual TLS) serves every test:

* ``loramesh adapters upload`` runs in a loop of 12 distinct adapters, each a separate command;
  after the 4th, the replica the gateway talks to is killed with SIGKILL. Every command must exit
  0, every adapter must be listed afterwards, and the killed replica must be back by itself
  (restarted by the supervisor, registered again in etcd, serving the whole catalog).
* With the supervisor held (SIGSTOP, so the replica stays down: no restart while the test works)
  the replica the gateway talks to is killed, an adapter is uploaded and a greedy completion is
  asked for with it; its tokens and text must be those of transformers + peft on the same
  weights (teacher-forced: HF's argmax at every step of the completion).

The same mesh checks tenant identities at the public API (issue 50): tenant ``bob`` holds the CA
and his API key, no certificate; he sees his own adapters and public ones only, and is refused
every operator RPC, in one line at the gateway's public port and at the handshake on the
internal ports (mutual TLS). It runs first, on the mesh as started.

Not covered yet (issue 48 stays open on it): a replica that hangs instead of dying (SIGSTOP:
alive, its connections open, answering nothing) is not failed over. The gateway's calls to its
store wait for their whole deadline (RegisterAdapter 300 s) and DEADLINE_EXCEEDED is not retried,
and its ServiceLocator keeps the replica it picked while the lease lingers
(services/gateway/service.py ``_Located``, services/runtime/etcd/discovery.py). gRPC keepalive
on the mesh's channels alone (10 s + 5 s) did not make such an upload finish within 45 s.

Waits are by condition, each bounded only by a hang guard (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from grpc import aio
from support.cli import loramesh
from support.hf_peft import hf_logits, near_ties
from support.polling import poll_until

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import Client, ClientTLS
from loramesh import errors as sdk_errors
from loramesh.tls import aio_channel as sdk_channel
from loramesh_cli.mesh_file import MeshFile, ServiceEntry, pid_alive
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.etcd.membership import MembershipConfig, list_members
from services.runtime.security.authorization import TABLE, TENANT

pytestmark = [pytest.mark.integration, pytest.mark.model]

STORES = ("adapter_store", "adapter_store-1")
UPLOADS = 12
KILL_AFTER = 4
"""The loop kills a replica once this many uploads have succeeded."""
PROMPT = "Write one sentence about rivers."
MAX_TOKENS = 16
COMEBACK_GUARD_S = 180
BOB_KEY = "lm-bob-e2e-key"
CALL_GUARD_S = 60
"""Hang guard only."""
SERVICE_KINDS = {
    "loramesh.v1.AdapterStore": "adapter_store",
    "loramesh.v1.Scheduler": "scheduler",
    "loramesh.v1.KVManager": "kv_manager",
    "loramesh.v1.Worker": "gpu_worker",
}
"""Which process serves each service's RPCs (health and reflection: every one)."""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("store-replicas")
    state = root / "state"
    tenants = root / "tenants.json"
    tenants.write_text(json.dumps({BOB_KEY: "bob"}))
    loramesh(
        state, "up", "--detach", "--adapter-stores", "2", "--workers", "1", "--gateways", "1",
        "--schedulers", "1", "--kv-managers", "1", "--dtype", "float32", "--pool-mib", "64",
        "--restart-backoff-s", "0.2", "--tls", "--api-keys-file", str(tenants),
    )  # fmt: skip
    try:
        yield state
    finally:
        mesh_file = MeshFile.read(state)
        if mesh_file is not None and pid_alive(mesh_file.up_pid):
            os.kill(mesh_file.up_pid, signal.SIGCONT)  # never leave the supervisor held
        loramesh(state, "down", check=False)


def store_in_use(mesh_file: MeshFile) -> str:
    """The replica the gateway's calls go to: the one it has a connection to. It picks a replica
    at random and keeps it while it answers; when it has connections to both (it went back to
    one that died and came back), the one that has not died most recently, which it moved to."""
    gateway = psutil.Process(mesh_file.services["gateway"].pid)
    peers = {
        f"{c.raddr.ip.removeprefix('::ffff:')}:{c.raddr.port}"  # IPv4-mapped on a dual-stack socket
        for c in gateway.net_connections("tcp")
        if c.raddr and c.status == psutil.CONN_ESTABLISHED
    }
    used = [name for name in STORES if mesh_file.services[name].address in peers]
    assert used, f"the gateway has no connection to a store replica: {sorted(peers)}"
    return min(used, key=lambda name: mesh_file.services[name].last_exit_unix)


def kill_9(entry: ServiceEntry) -> float:
    """SIGKILL ``entry``'s process and wait until it is gone; when it was killed (Unix time)."""
    killed_unix = time.time()
    os.kill(entry.pid, signal.SIGKILL)
    asyncio.run(
        poll_until(lambda: asyncio.sleep(0, entry.pid), lambda pid: not pid_alive(pid), "the store dead")
    )
    return killed_unix


async def registered(mesh_file: MeshFile) -> dict[str, float]:
    """instance id -> started_at of each store replica in etcd."""
    config = MembershipConfig(etcd_endpoints=mesh_file.etcd_endpoint, tls=mesh_file.tls_config())
    return {m.instance_id: m.started_at for m in await list_members(config, "adapter_store")}


def stores_status(state: Path) -> dict[str, dict]:
    """Each replica's row of ``loramesh status --json`` ({} while status cannot answer)."""
    done = loramesh(state, "status", "--json", check=False)
    if done.returncode != 0:
        return {}
    return {r["instance"]: r for r in json.loads(done.stdout) if r["service"] == "adapter_store"}


def wait_for_comeback(
    state: Path, name: str, before: ServiceEntry, killed_unix: float, adapters: int
) -> float:
    """Wait until the supervisor has restarted replica ``name``, it is registered in etcd again
    and both replicas serve a catalog of at least ``adapters``; seconds that took from now."""
    started = time.monotonic()

    async def comeback() -> None:
        restarted = await poll_until(
            lambda: asyncio.sleep(0, MeshFile.read(state).services[name]),
            lambda now: now.restarts > before.restarts and now.pid > 0,
            f"{name}'s restart in mesh.json",
            guard_s=COMEBACK_GUARD_S,
            interval_s=0.2,
        )
        assert restarted.last_exit == "killed by signal 9" and restarted.pid != before.pid
        assert pid_alive(restarted.pid)
        mesh_file = MeshFile.read(state)
        await poll_until(
            lambda: registered(mesh_file),
            lambda members: members.get(name, 0.0) > killed_unix and len(members) == len(STORES),
            f"{name} registered in etcd again",
            guard_s=COMEBACK_GUARD_S,
            interval_s=0.2,
        )
        await poll_until(
            lambda: asyncio.to_thread(stores_status, state),
            lambda rows: (
                rows.keys() == set(STORES)
                and all(
                    r["health"] == "SERVING"
                    and r["load"].get("catalog") == "ok"
                    and r["load"].get("adapters", -1) >= adapters
                    for r in rows.values()
                )
            ),
            "both replicas serving the whole catalog",
            guard_s=COMEBACK_GUARD_S,
            interval_s=1.0,
        )

    asyncio.run(comeback())
    return time.monotonic() - started


def both_registered(mesh_file: MeshFile) -> None:
    asyncio.run(
        poll_until(
            lambda: registered(mesh_file),
            lambda members: len(members) == len(STORES),
            "both replicas registered in etcd",
            guard_s=COMEBACK_GUARD_S,
            interval_s=0.2,
        )
    )


def listed_names(state: Path) -> set[str]:
    rows = loramesh(state, "adapters", "list").stdout.splitlines()
    assert rows[0].split()[:2] == ["NAME", "OWNER"]
    return {row.split()[0] for row in rows[1:] if row.strip()}


async def refusals(address: str, tls: ClientTLS, paths: list[str]) -> dict[str, aio.AioRpcError]:
    """Each RPC at ``paths`` called once at ``address`` with bob's key over ``tls``: its error."""
    errors = {}
    async with sdk_channel(address, tls) as channel:
        for path in paths:
            with pytest.raises(aio.AioRpcError) as refused:
                await channel.unary_unary(path)(
                    b"", metadata=(("authorization", f"Bearer {BOB_KEY}"),), timeout=CALL_GUARD_S
                )
            errors[path] = refused.value
    return errors


def test_tenant_bob_holds_no_certificate_sees_his_own_and_public_adapters_and_no_operator_rpc(
    mesh, tmp_path, base_spec
):
    mesh_file = MeshFile.read(mesh)
    gateway = mesh_file.gateway_addresses[0]
    ca_only = ClientTLS(mesh_file.tls["ca_file"])
    adapter = write_peft_adapter(tmp_path / "adapter", base_spec, SampleAdapterSpec(rank=4, seed=50))
    # The operator's tenant, through the SDK on mesh.json (its admin key and the CA alone).
    with Client(mesh_file=MeshFile.path(mesh), timeout=CALL_GUARD_S) as admin:
        admin.adapters.upload(adapter, "shared", public=True)
        admin.adapters.upload(adapter, "secret")
    with Client(gateway, BOB_KEY, tls=ca_only, mesh_file=tmp_path / "none.json", timeout=CALL_GUARD_S) as bob:
        assert bob.adapters.upload(adapter, "mine").owner == "bob"
        assert {(a.owner, a.name) for a in bob.adapters.list()} == {("bob", "mine"), ("admin", "shared")}
        assert {m.id for m in bob.models()} == {"", "mine", "admin/shared"}
        with pytest.raises(sdk_errors.NotFound, match="adapter 'secret' of owner 'admin' not found"):
            bob.adapters.get("admin/secret")

    not_for_tenants = sorted(f"/{s}/{m}" for (s, m), rule in TABLE.items() if TENANT not in rule.callers)
    operator_rpcs = [p for p in not_for_tenants if "operator" in TABLE[tuple(p[1:].rsplit("/", 1))].callers]
    assert len(operator_rpcs) > 10
    # At the public port: every RPC that is not a tenant's, served there or not, in one line. The
    # operator's certificate presented there changes nothing (the port reads none).
    operator = mesh_file.tls_config()
    with_operator_cert = ClientTLS(operator.ca_file, operator.cert_file, operator.key_file)
    for tls in (ca_only, with_operator_cert):
        at_gateway = asyncio.run(refusals(gateway, tls, not_for_tenants))
        for path, error in at_gateway.items():
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (path, error.details())
            assert error.details().startswith(f"{path[1:]} is not for tenants: only ")
            assert "\n" not in error.details()
    # At the internal ports, each operator RPC where it is served: refused at the handshake.
    for path in operator_rpcs:
        service = path[1:].rpartition("/")[0]
        kinds = [SERVICE_KINDS[service]] if service in SERVICE_KINDS else list(SERVICE_KINDS.values())
        for kind in kinds:
            address = next(e.address for n, e in mesh_file.services.items() if n.rsplit("-", 1)[0] == kind)
            (error,) = asyncio.run(refusals(address, ca_only, [path])).values()
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (path, kind, error.details())
            assert "\n" not in error.details()
    print(f"\nbob: his and the public adapter only; {len(not_for_tenants)} RPCs refused at the gateway "
          f"in one line, {len(operator_rpcs)} operator RPCs at the handshake of the internal ports")  # fmt: skip


def test_upload_loop_sees_only_successes_across_a_kill_9_of_a_store(mesh, tmp_path, base_spec):
    names = [f"loop-{i:02d}" for i in range(UPLOADS)]
    killed: tuple[str, ServiceEntry, float] | None = None
    for i, name in enumerate(names):
        directory = write_peft_adapter(tmp_path / name, base_spec, SampleAdapterSpec(rank=4, seed=100 + i))
        done = loramesh(mesh, "adapters", "upload", str(directory), "--name", name, check=False)
        assert done.returncode == 0, f"upload {i + 1} ({name}) after {KILL_AFTER} and a kill: {done.stderr}"
        assert done.stdout.startswith(f"registered admin/{name} "), done.stdout
        if i + 1 == KILL_AFTER:
            mesh_file = MeshFile.read(mesh)
            target = store_in_use(mesh_file)
            entry = mesh_file.services[target]
            killed = (target, entry, kill_9(entry))
    assert killed is not None
    assert set(names) <= listed_names(mesh)
    target, entry, killed_unix = killed
    back_s = wait_for_comeback(mesh, target, entry, killed_unix, UPLOADS)
    print(f"\nkill -9 {target} after upload {KILL_AFTER}: {UPLOADS} of {UPLOADS} uploads exited 0, "
          f"all listed; {target} back and serving the catalog {back_s:.1f} s after the loop")  # fmt: skip


@pytest.fixture(scope="module")
def loaded():
    return load_model(dtype=torch.float32)


def test_adapter_uploaded_while_a_store_is_down_generates_as_transformers_and_peft(
    mesh, tmp_path, base_spec, loaded
):
    mesh_file = MeshFile.read(mesh)
    both_registered(mesh_file)  # the previous test waits for it too; this one may run alone
    mesh_file = MeshFile.read(mesh)
    target = store_in_use(mesh_file)
    entry = mesh_file.services[target]
    directory = write_peft_adapter(
        tmp_path / "while-down",
        base_spec,
        SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, scale=0.05, seed=77),
    )
    # Held, the supervisor cannot restart the replica: it stays down (and, for its lease's TTL,
    # still listed in etcd) for the whole upload and generation.
    os.kill(mesh_file.up_pid, signal.SIGSTOP)
    try:
        killed_unix = kill_9(entry)
        done = loramesh(mesh, "adapters", "upload", str(directory), "--name", "while-down", check=False)
        assert done.returncode == 0, done.stderr
        with Client(mesh_file=MeshFile.path(mesh), timeout=300) as client:
            completion = client.generate(
                PROMPT, adapter="while-down", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0
            )
        assert not pid_alive(entry.pid)  # still down: the upload and the generation did without it
    finally:
        os.kill(mesh_file.up_pid, signal.SIGCONT)

    prompt = loaded.tokenizer.encode(PROMPT)
    tokens = list(completion.token_ids)
    assert len(tokens) == MAX_TOKENS and completion.finish_reason == "length"
    assert completion.usage.prompt_tokens == len(prompt)
    reference, base = hf_logits(loaded, directory, prompt, tokens)
    assert (reference - base).abs().max().item() > 0.1, "the adapter barely changes the logits"
    ties = near_ties(tokens, reference)
    if not ties:
        assert completion.text == loaded.tokenizer.decode(tokens)
    print(f"\n{target} down: upload and greedy completion {completion.text!r} as transformers + peft"
          f"{f'; near-tie flips {ties}' if ties else ''}")  # fmt: skip
    wait_for_comeback(mesh, target, entry, killed_unix, 1)
