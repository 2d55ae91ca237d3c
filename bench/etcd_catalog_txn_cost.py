"""What one adapter store catalog transaction costs, beside a real etcd (issue 48): etcd's CPU
a transaction by the registrations it holds, with and without two replicas watching the rows;
and this process's CPU and thread switches a transaction: its blocking ``Txn`` call, and with
watchers their responses too (the difference is what the watches cost; their own threads' part
is given apart). Each registration is shaped as the catalog commits one: its row (700
bytes) and five small keys written, four checks.

    .venv/bin/python -m bench.etcd_catalog_txn_cost --transactions 1500
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from aetcd import rpc

from bench.adapter_store_scale import cpu_model, process_cpu
from bench.store_replicas_bench import report, thread_switches
from bench.store_replicas_cpu_ab import thread_cpu
from services.adapter_store import etcd_ops
from services.adapter_store.blocking_etcd import BlockingEtcd
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig

ROWS = b"/bench/rows/"


class Registrations:
    """Transactions of registrations, each on keys of its own."""

    def __init__(self) -> None:
        self._next = 0

    def txn(self, registrations: int) -> rpc.TxnRequest:
        compare, success = [], []
        for _ in range(registrations):
            self._next += 1
            key = b"%032d" % self._next
            success.append(etcd_ops.put(ROWS + key, b"r" * 700))
            success += [etcd_ops.put(b"/bench/index%d/" % i + key, b"v" * 40) for i in range(5)]
            compare += [etcd_ops.absent(b"/bench/check%d/" % i + key) for i in range(4)]
        return rpc.TxnRequest(compare=compare, success=success)


class Watcher:
    """A replica's watch of the rows (as the catalog's), counting the CPU of its thread."""

    def __init__(self, config: MembershipConfig):
        self._etcd = BlockingEtcd(config)
        self.responses = 0
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for _ in self._etcd.watch(ROWS, ROWS[:-1] + b"0", 0, "watch the bench's rows"):
                self.responses += 1
        except Exception:  # noqa: BLE001 - closed
            return

    def cpu_s(self) -> float:
        return thread_cpu(os.getpid()).get(self._thread.native_id or 0, 0.0)

    def close(self) -> None:
        self._etcd.close()


def measure(etcd: EtcdServer, config: MembershipConfig, watchers: int, per_txn: int, count: int) -> dict:
    client = BlockingEtcd(config)
    watching = [Watcher(config) for _ in range(watchers)]
    shapes = Registrations()
    try:
        time.sleep(0.5)  # the watches are open
        requests = [shapes.txn(per_txn) for _ in range(count)]
        watch_before = [w.cpu_s() for w in watching]
        etcd_before, switches_before = process_cpu(etcd.pid)[0], thread_switches(os.getpid())
        started = time.process_time()
        for request in requests:
            client.one(request.compare, request.success, [], "commit")
        deadline = time.monotonic() + 10
        while any(w.responses < count for w in watching) and time.monotonic() < deadline:
            time.sleep(0.05)
        process_s = time.process_time() - started
        switches = thread_switches(os.getpid()) - switches_before
        etcd_s = process_cpu(etcd.pid)[0] - etcd_before
        watch_s = [w.cpu_s() - before for w, before in zip(watching, watch_before, strict=True)]
    finally:
        for w in watching:
            w.close()
        client.close()
    return {
        "watchers": watchers,
        "registrations_per_txn": per_txn,
        "etcd_cpu_us_per_txn": round(etcd_s * 1e6 / count),
        # This process: the committing calls, the watches (their threads and gRPC's for them).
        "process_cpu_us_per_txn": round(process_s * 1e6 / count),
        "process_thread_switches_per_txn": round(switches / count, 1),
        "watch_threads_cpu_us_per_response": [round(s * 1e6 / count) for s in watch_s],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=1500, help="transactions a measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="etcd-txn-cost-"))
    etcd = EtcdServer(work / "etcd").start()
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    rows = []
    try:
        measure(etcd, config, 0, 1, 200)  # warm up
        for _ in range(args.rounds):
            for watchers in (0, 2):
                for per_txn in (1, 2, 4):
                    load = os.getloadavg()[0]
                    row = measure(etcd, config, watchers, per_txn, args.transactions)
                    rows.append({**row, "load_average_1m": [round(load, 2), round(os.getloadavg()[0], 2)]})
                    print(json.dumps(rows[-1]))
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    report({"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
