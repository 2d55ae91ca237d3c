"""The CPU overlay run pod by pod (issue 49): every replica of every Deployment and StatefulSet
in its own network namespace on three nodes, its NetworkPolicies enforced by nftables, real
certificates, etcd as three members (bench/cluster/pods, docs/operations.md "Running the overlay
in network namespaces").

The run adds what an operator's overlay would: k8s/components/blob-volume (the overlay's own
bucket is a placeholder and nothing outside the machine is reached) and the nemesis's workers
(bench/cluster/nemesis.py ``worker_patch``): float32 (the overlay's ``auto`` is bfloat16 on this
CPU; the comparison with transformers + peft is in float32) and an 18 MiB KV pool that the
nemesis's long prompts overflow. The working tree's code runs, not a built image's.

One pod outside the overlay, ``outsider`` (namespace default, no labels), is the user: it
uploads a PEFT adapter and streams a greedy completion through the gateway Service by its name,
which must equal transformers + peft (teacher-forced, near ties reported). The same pod may
reach the gateway's public port but not a worker's: its connection attempt is seen dropped by
the worker's policy. Waits are by condition, each bounded only by a hang guard.

On the same running overlay, one short seeded nemesis round (issue 49): a kill-pod, a partition
and a 5% loss between two nodes while the load streams, borrows KV and uploads; nothing lost,
nothing corrupted, the KV ledger balanced. Its waits after the faults are bounded by hang guards
inside pytest's timeout, and each stream of its load by its deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch
from support.hf_peft import hf_logits, near_ties
from support.polling import poll_until

from bench.cluster.nemesis import NemesisConfig, run_round, worker_patch
from bench.cluster.pods.probes import netns_executor
from bench.cluster.pods.render import BLOB_VOLUME, RunOverlay
from bench.cluster.pods.runner import ClientPod, OverlayRun, RunConfig, RunFailed, exec_in
from bench.cluster.schedule import NemesisKind
from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS


def _namespaces_available() -> str:
    """Why this machine cannot run the overlay ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, mounts, nftables)"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode != 0:
        return "ip netns is not available"
    return ""


pytestmark = [
    pytest.mark.integration,
    pytest.mark.model,
    pytest.mark.skipif(bool(_namespaces_available()), reason=_namespaces_available() or "-"),
]

OUTSIDER = "outsider"
PROMPT = "Write one sentence about rivers."
MAX_TOKENS = 16
READY_GUARD_S = 420.0
"""A hang guard, not a timing claim: 14 pods start at once on a busy 2-core machine (below
pytest's 600 s timeout, so that a run that never gets ready fails with its diagnosis)."""


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    config = RunConfig(
        overlay=RunOverlay(components=(BLOB_VOLUME,), patches=(worker_patch(),)),
        nodes=3,
        clients=(ClientPod(OUTSIDER, node=1),),
        use_built_image=False,
        stop_grace_s=5.0,  # taking the run down is not under test: what lingers is killed sooner
        work_dir=tmp_path_factory.mktemp("overlay-pods"),
    )
    with OverlayRun(config) as run:
        try:
            asyncio.run(poll_until(lambda: asyncio.to_thread(run.all_ready), bool, "every pod ready",
                                   guard_s=READY_GUARD_S, interval_s=1.0))  # fmt: skip
        except (AssertionError, RunFailed) as error:
            pytest.fail(f"{error}\n{run.diagnosis()}")
        yield run


def test_a_greedy_stream_through_the_gateway_service_equals_transformers_and_peft(
    overlay, tmp_path, base_spec
):
    assert len(overlay.pods_of("StatefulSet/etcd")) == 3
    assert len({p.node for p in overlay.pods}) == 3
    directory = write_peft_adapter(
        tmp_path / "rivers",
        base_spec,
        SampleAdapterSpec(rank=8, target_modules=LORA_TARGETS, scale=0.05, seed=49),
    )
    assert overlay.secrets is not None
    done = subprocess.run(
        ["ip", "netns", "exec", overlay.netns_of(OUTSIDER), sys.executable, "-m", "bench.cluster.pods.user_call",
         "--gateway", "gateway.loramesh.svc.cluster.local:50050", "--api-key", overlay.secrets.api_key,
         "--tls", *map(str, overlay.secrets.admin_files()), "--adapter-dir", str(directory), "--name", "rivers",
         "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n{overlay.diagnosis()}"
    completion = json.loads(done.stdout)
    overlay.check()  # nothing the mesh needed was dropped on the way

    loaded = load_model(dtype=torch.float32)
    prompt, tokens = loaded.tokenizer.encode(PROMPT), completion["token_ids"]
    assert len(tokens) == MAX_TOKENS and completion["finish_reason"] == "length"
    assert completion["prompt_tokens"] == len(prompt)
    reference, base = hf_logits(loaded, directory, prompt, tokens)
    assert (reference - base).abs().max().item() > 0.1, "the adapter barely changes the logits"
    ties = near_ties(tokens, reference)
    if not ties:
        assert completion["text"] == loaded.tokenizer.decode(tokens)
    print(f"\nthrough gateway.loramesh.svc: {completion['text']!r} as transformers + peft"
          f"{f'; near-tie flips {ties}' if ties else ''}")  # fmt: skip


def _connect_from(netns: str, address: tuple[str, int]) -> Future:
    """A non-blocking connect to ``address`` from ``netns``; the future holds the socket."""
    executor = netns_executor(netns, workers=1)

    def connect() -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(address)
        return sock

    try:
        return executor.submit(connect)
    finally:
        executor.shutdown(wait=False)


def test_a_pod_outside_the_mesh_reaches_the_gateway_but_not_a_worker(overlay):
    outsider = overlay.clients[OUTSIDER].ip
    worker = overlay.pods_of("Deployment/gpu-worker")[0]
    gateway = overlay.service("gateway")
    blocked = _connect_from(overlay.netns_of(OUTSIDER), (worker.ip, 50052)).result()
    allowed = _connect_from(overlay.netns_of(OUTSIDER), (gateway.vip, 50050)).result()
    try:
        asyncio.run(poll_until(lambda: asyncio.to_thread(overlay.blocked_flows, worker.name),
                               lambda flows: (outsider, 50052) in flows, "the worker's policy dropping the outsider"))  # fmt: skip
        # The gateway's public port, through its Service: the connection completes.
        asyncio.run(
            poll_until(lambda: asyncio.sleep(0, _connected(allowed)), bool, "the gateway's port accepting")
        )
        assert (outsider, 50052) not in overlay.blocked_flows(gateway.endpoints[0].name)
        # A mesh pod's own traffic was never dropped (the policies admit everything it needs).
        overlay.check()
        assert (
            exec_in(overlay, OUTSIDER, "getent", "hosts", "gateway.loramesh.svc.cluster.local").split()[0]
            == gateway.vip
        )
    finally:
        blocked.close()
        allowed.close()


def _connected(sock: socket.socket) -> bool:
    """A non-blocking connect has completed, without error."""
    writable = bool(select.select([], [sock], [], 0)[1])
    return writable and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


NEMESIS_SEED = 48
"""Draws a round of three faults: a gpu-worker killed (its streams continue on the other), a
gateway cut off from the schedulers, 5% loss between two nodes (bench/cluster/schedule.py)."""
NEMESIS_DURATION_S = 51.0
"""The seed's three faults and their tail, no more: the last heals at 42.1 s, 8 s of tail after it
(its own quiet, so the next draw does not fit). Until the run ends the load streams and the
schedule idles, so a longer run only adds wall time."""
NEMESIS_HANG_GUARD_S = 120.0
"""Each of the round's waits (the load's first operation; after its 51 s, pods ready again, the
load's end, the loans back) is bounded by this hang guard, not a timing claim: 51 + 4 x 120 s
stays inside pytest's 600 s timeout, so a stuck round fails here naming what it waited for, and
the suite goes on."""


def test_a_short_seeded_nemesis_round_loses_nothing_and_balances_the_ledger(overlay, tmp_path):
    config = NemesisConfig(
        kinds=(NemesisKind.KILL_POD, NemesisKind.PARTITION, NemesisKind.LOSS),
        duration_s=NEMESIS_DURATION_S,
        seed=NEMESIS_SEED,
        client=OUTSIDER,
        out=tmp_path / "nemesis",
        warmup_s=8.0,
        fault_s=(6.0, 10.0),
        quiet_s=(3.0, 5.0),
        tail_s=8.0,
        hang_guard_s=NEMESIS_HANG_GUARD_S,
    )
    result = run_round(overlay, config)
    print(f"\n{result.report}")
    verdict = result.verdict
    assert [a.fault.kind for _, _, a in result.applied] == [
        NemesisKind.KILL_POD, NemesisKind.PARTITION, NemesisKind.LOSS
    ], result.report  # fmt: skip
    assert not any(a.skipped for _, _, a in result.applied), result.report
    assert verdict.sent > 0 and verdict.streams > 0 and verdict.ledger == [], result.report
    # The kill found streams in flight (the schedule starts once the load runs, and its clients
    # stream back to back); their stalls, read from the per-token times, are reported, not
    # judged: they measure the machine.
    assert "failover after kill-pod (1): " in result.report
    assert "failover after kill-pod (1): no stream in flight" not in result.report
    # A stream's deadline (the load's stream_deadline_s, minutes) is a hang guard in a 51 s round:
    # one that reaches it was stuck, as the borrowing queue once held them.
    assert not verdict.timed_out, result.report
    assert verdict.holds, f"{result.report}\n{overlay.diagnosis()}"
    assert verdict.summary.endswith("0 lost, 0 corrupted, ledger balanced")
