"""What a registration costs two adapter store replicas over etcd, old code against new, in one
process (the A/B for the replicas' registration path, issue 48).

Rounds alternate between the replicas of ``--old-ref`` (a git worktree this script makes) and of
this checkout; each round gets a fresh etcd and blob directory, registers ``--adapters`` small
adapters (as :mod:`bench.store_replicas_bench` does) ``--concurrency`` at a time over the two
replicas, and reports the rate, the CPU a registration of the stores (together) and of etcd
(from ``/proc/<pid>/stat``), the stores' thread switches, etcd's writes a registration (its
revisions: one a transaction, so the inverse of the registrations a commit group holds), and
each store thread's CPU and thread switches (by thread name, from ``py-spy dump``, when
``--threads``). Rates on a shared machine move with others' load; the CPU a registration moves
less, and the rounds alternate so both see the same.

    .venv/bin/python -m bench.store_replicas_cpu_ab --old-ref HEAD~1 --adapters 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.adapter_store_scale import cpu_model, run_all
from bench.store_replicas_bench import (
    OWNER,
    REPO,
    CpuSample,
    StoreSystem,
    baseline_checkout,
    bench_adapters,
    each_in_turn,
    ready_stubs,
    remove_checkout,
    report,
    start_store,
)
from mesh_api.adapter_transfer import upload_adapter
from services.adapter_store.blocking_etcd import BlockingEtcd
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` so far, by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def thread_switches(pid: int) -> dict[int, float]:
    """Context switches of each thread of ``pid`` so far (voluntary and not), by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except OSError:
            continue
        out[int(task.name)] = float(sum(int(line.split()[1]) for line in lines if "ctxt_switches" in line))
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by thread id (``py-spy dump``); gRPC's and other native threads are
    not listed."""
    py_spy = Path(sys.executable).with_name("py-spy")
    dump = subprocess.run(
        [str(py_spy), "dump", "--pid", str(pid)], check=False, capture_output=True, text=True
    ).stdout
    names = {}
    for match in re.finditer(r'Thread (0x[0-9A-Fa-f]+|\d+) \([^)]*\): "([^"]*)"', dump):
        with_tid = re.search(r"\(tid (\d+)\)|Thread (\d+)", match.group(0))
        if with_tid:
            names[int(with_tid.group(1) or with_tid.group(2))] = match.group(2)
    return names


def etcd_revision(etcd: EtcdServer) -> int:
    """etcd's revision now: the writes (transactions included) since its start."""
    client = BlockingEtcd(MembershipConfig(etcd_endpoints=etcd.endpoint))
    try:
        return client.range_page(b"\0", b"", 1, 0, "read the revision").header.revision
    finally:
        client.close()


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def by_name(
    pid: int, before: dict[int, float], after: dict[int, float], names: dict[int, str], per: float
) -> dict:
    """What each thread took a registration (``per``: 1,000 / registrations for ms of CPU
    seconds, 1 / registrations for counts), by thread name (similar names, e.g. executor
    threads, summed)."""
    totals: Counter[str] = Counter()
    for tid, value in after.items():
        name = re.sub(r"_\d+$", "_N", names.get(tid) or "native " + _comm(pid, tid))
        totals[name] += (value - before.get(tid, 0.0)) * per
    return {name: round(value, 3) for name, value in totals.most_common() if value >= 0.01}


async def one_round(system: StoreSystem, adapters, args, work: Path) -> dict:
    load = [os.getloadavg()[0]]
    etcd = EtcdServer(work / "etcd").start()
    env = dict(item.split("=", 1) for item in args.new_env) if system.source == REPO else {}
    stores = [start_store(system, etcd, work, i, env) for i in range(2)]
    try:
        channels, stubs = await ready_stubs(stores)

        async def register(i: int) -> int:
            await upload_adapter(stubs[i % 2], adapters[i], f"a{i:05d}", OWNER)
            return 1

        warm = min(200, len(adapters) // 10)
        await run_all(warm, args.concurrency, register)
        threads_before = [thread_cpu(store.proc.pid) for store in stores]
        switches_before = [thread_switches(store.proc.pid) for store in stores]
        before, revision = CpuSample.now(stores, etcd), etcd_revision(etcd)

        async def rest(i: int) -> int:
            return await register(warm + i)

        seconds, registered = await run_all(len(adapters) - warm, args.concurrency, rest)
        cpu = CpuSample.now(stores, etcd).per_registration(before, registered)
        writes = etcd_revision(etcd) - revision
        # Named after the run: the executor starts threads as the uploads need them.
        names = [thread_names(store.proc.pid) for store in stores] if args.threads else [{}, {}]
        threads = [
            by_name(store.proc.pid, b, thread_cpu(store.proc.pid), n, 1000 / registered)
            for b, store, n in zip(threads_before, stores, names, strict=True)
        ]
        switches = [
            by_name(store.proc.pid, b, thread_switches(store.proc.pid), n, 1 / registered)
            for b, store, n in zip(switches_before, stores, names, strict=True)
        ]
        for channel in channels:
            await channel.close()
        load.append(os.getloadavg()[0])
        return {
            "code": system.name + (f" {' '.join(args.new_env)}" if env else ""),
            "registered": registered,
            "registration_per_s": round(registered / seconds, 1),
            **cpu,
            "etcd_writes_per_registration": round(writes / registered, 3),
            **(
                {"store_threads_ms_per_registration": threads, "store_thread_switches_by_thread": switches}
                if args.threads
                else {}
            ),
            "load_average_1m": [round(x, 2) for x in load],
        }
    finally:
        for store in stores:
            store.kill()
        etcd.stop()


async def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="store-cpu-ab-"))
    old = baseline_checkout(args.old_ref, root)
    try:
        adapters = bench_adapters(root, args.adapters)
        systems = [
            StoreSystem(f"old ({args.old_ref})", 2, old, shared_blobs=True),
            StoreSystem("new", 2, REPO, shared_blobs=True),
        ]
        order = (systems[::-1] if args.new_first else systems) * args.rounds
        rows = await each_in_turn(root, order, lambda s, work: one_round(s, adapters, args, work))
    finally:
        remove_checkout(old)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "adapters": args.adapters,
        "concurrency": args.concurrency,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-ref", required=True, help="the commit whose replicas are the A side")
    parser.add_argument("--adapters", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each, alternating")
    parser.add_argument("--new-first", action="store_true", help="start each pair with the new code")
    parser.add_argument("--threads", action="store_true", help="also each store thread's CPU (py-spy dump)")
    parser.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable of the new code's stores (again for more)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = parser.parse_args()
    report(asyncio.run(run(args)), args.out)


if __name__ == "__main__":
    main()
