"""What sharing a tenant's concurrency limit across the gateways costs an admission (issue 50,
part 5).

One gateway's quota in this process over a fresh etcd: ``--admissions`` generations of one tenant
admitted and settled one after the other, the tenant limited to ``max_concurrent_requests`` 4
(a slot taken in etcd at admission, freed off the loop at the end) and, interleaved round by
round so that a busy machine slows both alike, the same quota kept by this gateway alone (no
etcd); the median and 99th percentile of ``acquire``'s latency for each, ``--repeats`` rounds.

    python -m bench.gateway_shared_quota_bench --admissions 300 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from services.gateway.shared_quota import SharedQuota
from services.gateway.tenant_quota import TenantQuota
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.membership import MembershipConfig
from services.runtime.tenants_file import QuotaConfig, TenantLimits

LIMITS = QuotaConfig({"alice": TenantLimits(max_concurrent_requests=4)})


async def admission_latencies(quota: TenantQuota, admissions: int) -> list[float]:
    """Seconds each ``acquire`` took, one generation in flight at a time."""
    latencies = []
    for _ in range(admissions):
        start = time.perf_counter()
        admission = await quota.acquire("alice", 100)
        latencies.append(time.perf_counter() - start)
        admission.settle(100)
        await asyncio.sleep(0)  # the settle's release runs off the loop, as between requests
    return latencies


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"median {statistics.median(ordered) * 1000:.3f} ms, p99 {p99 * 1000:.3f} ms"


async def run(endpoint: str, admissions: int, repeats: int) -> None:
    shared = SharedQuota(MembershipConfig(etcd_endpoints=endpoint), "bench-gateway")
    await shared.start()
    try:
        variants = {
            "this gateway alone": TenantQuota(LIMITS),
            "shared through etcd": TenantQuota(LIMITS, shared=shared),
        }
        seen: dict[str, list[float]] = {name: [] for name in variants}
        await admission_latencies(variants["shared through etcd"], 20)  # the lease and connection
        for _ in range(repeats):
            for name, quota in variants.items():
                seen[name] += await admission_latencies(quota, admissions)
        for name, latencies in seen.items():
            print(f"{name}: {len(latencies)} admissions, {summary(latencies)}")
    finally:
        await shared.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admissions", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shared-quota-bench-"))
    etcd = EtcdServer(root / "etcd").start()
    try:
        asyncio.run(run(etcd.endpoint, args.admissions, args.repeats))
    finally:
        etcd.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
