"""Adapter store replicas over etcd against the single-replica SQLite store (issue 48), side by
side in one run on one machine.

Each system gets a fresh etcd and work directory, then:

- registration: ``--adapters`` small adapters (rank 1 on q_proj, ~75 KB, each with its own bytes)
  uploaded ``--concurrency`` at a time, spread over the system's replicas; the rate in adapters/s;
- fetch: ``--fetches`` adapters chosen at random, ``--concurrency`` at a time, over the replicas;
  p50 and p99 of one fetch (each adapter's first read comes from the blob tier, later ones from
  the RAM tier, as in service);
- restart: every replica stopped, one started again over what they held, timed until it serves
  (health SERVING) and lists every adapter;
- size: etcd's database per 1,000 adapters (``Status.dbSize``) and, for the SQLite store, its
  catalog file's;
- CPU per registration: the stores' (together), etcd's and this client's, in ms, and the stores'
  thread switches (every thread's, voluntary or not, from ``/proc``): what a registration costs,
  which a loaded machine changes less than the rate;
- the machine's 1-minute load average before and after each system's run (others' jobs share it).

Both systems are driven alike: one client process (this one) uploads and fetches over gRPC with
the same concurrency, and each store process runs in a session of its own, as ``loramesh up``
starts it (with the kernel's autogroups the CPU is shared between sessions first: under others'
load, the replicated system's four busy sessions, two stores, etcd and this client, get a larger
share of the machine than the SQLite store's two, which favours the replicas, not the baseline).
``--one-session`` keeps every process of each system in this client's session instead, so that
each system gets one session's share of a loaded machine.

The SQLite store is the code at ``--baseline-ref`` (a git worktree the bench makes), run from its
own directory with this checkout's virtual environment.

    .venv/bin/python -m bench.store_replicas_bench --adapters 10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from grpc import aio

from bench.adapter_store_scale import cpu_model, percentile, process_cpu, run_all, variant
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import fetch_adapter, ref_by_name, upload_adapter
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc
from services.model_files.base_model import load_base_model_spec
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import EtcdConnection, MembershipConfig
from services.runtime.process.process import ServiceProcess

OWNER = "bench"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StoreSystem:
    """One way of running the store."""

    name: str
    replicas: int
    source: Path
    """The checkout whose ``services`` package the stores run."""
    shared_blobs: bool
    """Replicas share one blob directory (the etcd catalog); else each has its data dir alone."""


def baseline_checkout(ref: str, work: Path) -> Path:
    """A git worktree of ``ref`` under ``work`` (removed by :func:`remove_checkout`)."""
    path = work / f"baseline-{ref}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True)  # fmt: skip
    return path


def remove_checkout(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False, capture_output=True
    )


@contextlib.contextmanager
def sessions(own: bool) -> Iterator[None]:
    """Processes started meanwhile (stores, etcd) get a session of their own each, as ``loramesh
    up`` starts them (``own``), or stay in this client's session."""
    if own:
        yield
        return
    popen = subprocess.Popen

    def in_this_session(*args, **kwargs):
        return popen(*args, **{**kwargs, "start_new_session": False})

    with mock.patch.object(subprocess, "Popen", in_this_session):
        yield


def start_store(
    system: StoreSystem, etcd: EtcdServer, work: Path, index: int, env: dict[str, str] | None = None
) -> ServiceProcess:
    """A store process of ``system`` (run from its checkout, so its code is what runs), with
    ``env`` added to its environment."""
    args = ["--etcd-endpoints", etcd.endpoint, "--data-dir", str(work / f"store{index}")]
    if system.shared_blobs:
        args += ["--blob-store", str(work / "blobs")]
    store = ServiceProcess("adapter_store", args, log_path=work / f"store{index}.log")
    with open(work / f"store{index}.log", "ab") as log:
        store.proc = subprocess.Popen(store.command(), cwd=system.source, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, env={**os.environ, **(env or {})})  # fmt: skip
    return store


def thread_switches(pid: int) -> int:
    """Context switches of every thread of process ``pid`` so far, voluntary or not."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            for line in (task / "status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.endswith("ctxt_switches"):
                    total += int(value)
    return total


@dataclass(frozen=True)
class CpuSample:
    """What a system's processes have used so far."""

    stores_s: float
    etcd_s: float
    client_s: float
    store_switches: int

    @classmethod
    def now(cls, stores: Sequence[ServiceProcess], etcd: EtcdServer) -> CpuSample:
        pids = [store.proc.pid for store in stores]
        return cls(
            sum(process_cpu(pid)[0] for pid in pids),
            process_cpu(etcd.pid)[0] if etcd.pid else 0.0,
            time.process_time(),
            sum(thread_switches(pid) for pid in pids),
        )

    def per_registration(self, before: CpuSample, registered: int) -> dict:
        n = max(registered, 1)
        return {
            "store_cpu_ms_per_registration": round((self.stores_s - before.stores_s) * 1000 / n, 3),
            "etcd_cpu_ms_per_registration": round((self.etcd_s - before.etcd_s) * 1000 / n, 3),
            "client_cpu_ms_per_registration": round((self.client_s - before.client_s) * 1000 / n, 3),
            "store_thread_switches_per_registration": round(
                (self.store_switches - before.store_switches) / n, 1
            ),
        }


async def etcd_db_bytes(etcd: EtcdServer) -> int:
    connection = EtcdConnection(MembershipConfig(etcd_endpoints=etcd.endpoint))
    try:
        status = await connection.call(lambda c: c.status())
        return int(status.db_size)
    finally:
        await connection.close()


async def ready_stubs(stores: Sequence[ServiceProcess]) -> tuple[list[aio.Channel], list]:
    """Once every store serves: a channel to each and its stub."""
    for store in stores:
        await store.wait_ready(300)
    channels = [aio.insecure_channel(store.address) for store in stores]
    return channels, [adapter_store_pb2_grpc.AdapterStoreStub(channel) for channel in channels]


async def measure(system: StoreSystem, adapters: Sequence[dict[str, bytes]], args, work: Path) -> dict:
    load_before = os.getloadavg()[0]
    with sessions(not args.one_session):
        etcd = EtcdServer(work / "etcd").start()
        stores = [start_store(system, etcd, work, i) for i in range(system.replicas)]
    try:
        channels, stubs = await ready_stubs(stores)

        async def register(i: int) -> int:
            await upload_adapter(stubs[i % len(stubs)], adapters[i], f"a{i:05d}", OWNER)
            return 1

        cpu_before = CpuSample.now(stores, etcd)
        register_s, registered = await run_all(len(adapters), args.concurrency, register)
        cpu = CpuSample.now(stores, etcd).per_registration(cpu_before, registered)
        rng = random.Random(0)
        picks = [rng.randrange(len(adapters)) for _ in range(args.fetches)]
        latencies: list[float] = []

        async def fetch(j: int) -> int:
            started = time.perf_counter()
            await fetch_adapter(stubs[j % len(stubs)], ref_by_name(OWNER, f"a{picks[j]:05d}"))
            latencies.append(time.perf_counter() - started)
            return 1

        await run_all(args.fetches, args.concurrency, fetch)
        for channel in channels:
            await channel.close()
        db_bytes = await etcd_db_bytes(etcd)
        for store in stores:
            store.terminate()
        with sessions(not args.one_session):
            restarted = start_store(system, etcd, work, 0)
        started = time.perf_counter()
        await restarted.wait_ready(600)
        async with aio.insecure_channel(restarted.address) as channel:
            listed = await adapter_store_pb2_grpc.AdapterStoreStub(channel).ListAdapters(
                pb.ListAdaptersRequest(owner=OWNER, page_size=1)
            )
        restart_s = time.perf_counter() - started
        restarted.terminate()
        sqlite = work / "store0" / "catalog.sqlite3"
        return {
            "system": system.name,
            "replicas": system.replicas,
            "registered": registered,
            "registration_per_s": round(registered / register_s, 1),
            **cpu,
            "fetch_p50_ms": round(percentile(latencies, 50) * 1000, 2),
            "fetch_p99_ms": round(percentile(latencies, 99) * 1000, 2),
            "restart_s": round(restart_s, 2),
            "listed_after_restart": listed.total,
            "etcd_db_mib_per_1000": round(db_bytes / 2**20 / (registered / 1000), 3),
            "sqlite_mib_per_1000": round(sqlite.stat().st_size / 2**20 / (registered / 1000), 3) if sqlite.exists() else None,
            "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        }  # fmt: skip
    finally:
        for store in stores:
            store.kill()
        etcd.stop()


def bench_adapters(root: Path, count: int) -> list[dict[str, bytes]]:
    """``count`` small adapters (rank 1 on q_proj), each with its own bytes."""
    template = adapter_files(
        write_peft_adapter(
            root / "template",
            load_base_model_spec(),
            SampleAdapterSpec(rank=1, target_modules=("q_proj",), seed=7),
        )
    )
    return [variant(template, i) for i in range(count)]


async def each_in_turn(
    root: Path, systems: Sequence[StoreSystem], measure_one: Callable[[StoreSystem, Path], Awaitable[dict]]
) -> list[dict]:
    """``measure_one(system, work)`` of each system in turn, each with a work directory of its
    own under ``root`` (removed after): their rows, each printed as it comes."""
    rows = []
    for i, system in enumerate(systems):
        work = root / f"run{i}"
        work.mkdir()
        rows.append(await measure_one(system, work))
        shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


async def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="store-replicas-"))
    baseline = baseline_checkout(args.baseline_ref, root)
    try:
        adapters = bench_adapters(root, args.adapters)
        systems = [
            StoreSystem(f"sqlite store ({args.baseline_ref})", 1, baseline, shared_blobs=False),
            *(StoreSystem(f"etcd catalog, {n} replica{'s' * (n > 1)}", n, REPO, shared_blobs=True) for n in args.replicas),
        ]  # fmt: skip
        rows = await each_in_turn(
            root, systems * args.rounds, lambda s, work: measure(s, adapters, args, work)
        )
    finally:
        remove_checkout(baseline)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "adapters": args.adapters,
        "concurrency": args.concurrency,
        "one_session": args.one_session,
        "rows": rows,
    }


def report(result: dict, out: Path | None) -> None:
    """Print ``result`` (JSON), and write it to ``out`` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--fetches", type=int, default=2_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the systems")
    parser.add_argument("--replicas", type=lambda text: [int(n) for n in text.split(",")], default=[2, 1],
                        help="the etcd catalog's systems, by replica count, run after the SQLite store")  # fmt: skip
    parser.add_argument("--one-session", action="store_true",
                        help="run each system's stores and etcd in this client's session: under the kernel's "
                             "autogroups and others' load, each system then gets one session's share")  # fmt: skip
    parser.add_argument("--baseline-ref", default="44f3e5a", help="the single-replica SQLite store's commit")
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = parser.parse_args()
    report(asyncio.run(run(args)), args.out)


if __name__ == "__main__":
    main()
