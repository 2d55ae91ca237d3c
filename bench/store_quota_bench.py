"""What the tenants' storage and upload limits cost a registration (issue 50, part 4).

One replica in this process over a fresh etcd and blob directory, one tenant registering
``--adapters`` adapters ``--concurrency`` at a time (each upload admitted as the servicer admits
it: a slot, then the registration), under each set of limits in turn, ``--repeats`` rounds
interleaved so that a busy machine slows every variant alike; the median rate of each. Then the
time to read a tenant's usage from etcd at ``--usage-entries`` adapters (every registration of a
limited tenant reads it before staging, and its group's commit once more).

    python -m bench.store_quota_bench --adapters 100 --concurrency 8 --rank 16
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import aetcd

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.catalog import Catalog
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterRepository, RepositorySettings
from services.adapter_store.validation import ValidationLimits
from services.model_files.base_model import load_base_model_spec
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig
from services.runtime.tenants_file import QuotaConfig, TenantLimits

ROOMY = {"max_adapters": 10**6, "max_stored_bytes": 10**15}
VARIANTS = {
    "no limits": {},
    "storage": ROOMY,
    "uploads": {"max_concurrent_uploads": 64},
    "all three": {**ROOMY, "max_concurrent_uploads": 64},
}


def register_all(repository: AdapterRepository, files: list[dict[str, bytes]], concurrency: int) -> float:
    """Registrations per second of every adapter of ``files``, ``concurrency`` at a time."""
    pending, lock = iter(range(len(files))), threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            admission = repository.quota.admit("alice", True)
            try:
                upload = AdapterUpload(
                    f"n{i}",
                    "alice",
                    PRIVATE,
                    files[i]["adapter_config.json"],
                    files[i]["adapter_model.safetensors"],
                )
                repository.registrar.register(upload)
            finally:
                admission.release()

    started = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(files) / (time.perf_counter() - started)


def usage_read_ms(endpoint: str, entries: int) -> float:
    """Median time of reading a tenant's usage at ``entries`` adapters (entries put directly)."""
    catalog = Catalog(
        MembershipConfig(etcd_endpoints=endpoint, key_prefix="/usage-read"), lambda digest: "", "bench"
    )
    catalog.open()
    t = aetcd.transactions
    for start in range(0, entries, 100):
        puts = [
            t.Put(catalog.keys.usage_entry("big", f"{i:032x}").encode(), b"4718592")
            for i in range(start, min(entries, start + 100))
        ]
        catalog.etcd_call(lambda c, puts=puts: c.transaction(compare=[], success=puts, failure=[]), "fill")
    times = []
    for _ in range(11):
        started = time.perf_counter()
        catalog.usage("big")
        times.append(time.perf_counter() - started)
    catalog.close()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--usage-entries", type=int, nargs="*", default=[1000, 10000])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="store-quota-bench-"))
    spec = load_base_model_spec()
    sample = SampleAdapterSpec(rank=args.rank, target_modules=tuple(args.targets.split(",")))
    files = [
        adapter_files(write_peft_adapter(root / f"a{i}", spec, dataclasses.replace(sample, seed=i)))
        for i in range(args.adapters)
    ]
    etcd = EtcdServer(root / "etcd").start()
    try:
        rates: dict[str, list[float]] = {}
        for round_ in range(args.repeats):
            for label, limits in VARIANTS.items():
                blob_dir = root / f"blobs-{round_}-{len(rates.get(label, []))}-{label.replace(' ', '_')}"
                repository = AdapterRepository(
                    LocalDirectoryBlobs(blob_dir),
                    MembershipConfig(
                        etcd_endpoints=etcd.endpoint, key_prefix=f"/r{round_}{label.replace(' ', '')}"
                    ),
                    spec,
                    ValidationLimits(),
                    RepositorySettings(tenants=QuotaConfig({"*": TenantLimits(**limits)})),
                )
                repository.open()
                rates.setdefault(label, []).append(register_all(repository, files, args.concurrency))
                repository.close()
                shutil.rmtree(blob_dir)
        size = len(files[0]["adapter_model.safetensors"])
        print(f"{args.adapters} adapters of {size / 2**20:.2f} MiB, {args.concurrency} at a time:")
        base = statistics.median(rates["no limits"])
        for label, runs in rates.items():
            median = statistics.median(runs)
            print(
                f"  {label:10s} {median:7.1f}/s ({median / base:.2f}x)  runs {', '.join(f'{r:.0f}' for r in runs)}"
            )
        for entries in args.usage_entries:
            print(f"  usage read at {entries} adapters: {usage_read_ms(etcd.endpoint, entries):.1f} ms")
    finally:
        etcd.stop()
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
