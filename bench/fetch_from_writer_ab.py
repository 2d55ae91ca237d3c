"""A worker's pull of a version just published: from the store replica that committed it, or
from the other one, side by side in one process.

    .venv/bin/python -m bench.fetch_from_writer_ab [--rounds 20] [--mb 9.8]

Two adapter store replicas (one etcd, one blob directory, as ``loramesh up`` runs them) in this
process. Each round publishes a new version of one name through the *writer* (its weights go into
the writer's RAM tier before its row commits), then pulls it the way a worker's source does
(:class:`services.gpu_worker.adapter_source.StoreSource`) in one of three ways, in turn:

- *other*: from the replica that did not take the write (what a worker whose locator picked it
  did before: that replica reads the blob back from disk and hashes it);
- *writer*: from the replica that took it (what a worker whose locator picked the writer did);
- *just published*: ``fetch(..., just_published=True)`` on a source that discovers the replicas
  in etcd and tried the other one first (what a worker does now: the other replica refuses from
  its RAM tier, the writer sends it).

Reported per way: the pull's wall time, from the publish's acknowledgment (p50, max), this
process's CPU for it (the replicas and the client together, ``time.process_time``), and the RAM
tier misses (blob reads) it caused. Prints one JSON object; load averages before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, types_pb2
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gpu_worker.adapter_source import StoreSource
from services.model_files.base_model import load_base_model_spec
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.etcd import discovery
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.rpc.server import start_service

WAYS = ("other", "writer", "just_published")


class _Prefer:
    """Stands in for :mod:`random` in the locator: the first pick is ``address``."""

    def __init__(self, address: str):
        self.address = address

    def choice(self, options):
        return self.address if self.address in options else options[0]


async def publish(stub, files: dict[str, bytes]) -> str:
    """A new version published (acknowledged: committed), its id."""
    wire = upload_wire(files, "policy", "bench", types_pb2.VISIBILITY_PRIVATE, new_version=True)
    reply = await stub.RegisterAdapter(
        map(adapter_store_pb2.RegisterAdapterRequest.FromString, wire), timeout=60
    )
    return reply.adapter.id


async def misses(stub) -> int:
    return (await stub.Stats(adapter_store_pb2.StatsRequest())).ram_misses


async def run(args, work: Path) -> dict:
    spec = load_base_model_spec()
    sample = SampleAdapterSpec(rank=args.rank, lora_alpha=2.0 * args.rank, target_modules=LORA_TARGETS)
    contents = [
        adapter_files(
            write_peft_adapter(work / f"s{i}", spec, SampleAdapterSpec(**{**vars(sample), "seed": i}))
        )
        for i in range(args.rounds * len(WAYS) + 1)
    ]
    etcd = EtcdServer(work / "etcd").start()
    hosts = []
    try:
        for index in range(2):
            config = AdapterStoreConfig(
                data_dir=str(work / f"replica{index}"),
                blob_store=str(work / "blobs"),
                etcd_endpoints=etcd.endpoint,
                host="127.0.0.1",
                grace_s=1,
            )
            hosts.append(await start_service(AdapterStoreService(config), config))
        other, writer = (host.address for host in hosts)
        channels = [aio.insecure_channel(address) for address in (other, writer)]
        other_stub, writer_stub = (adapter_store_pb2_grpc.AdapterStoreStub(c) for c in channels)
        discovery.random = _Prefer(other)  # the discovering source tries the other one first
        sources = {
            "other": StoreSource(other),
            "writer": StoreSource(writer),
            "just_published": StoreSource(etcd_endpoints=etcd.endpoint),
        }
        results: dict[str, dict[str, list[float]]] = {
            w: {"wall_ms": [], "cpu_ms": [], "misses": []} for w in WAYS
        }
        await publish(writer_stub, contents[-1])  # warm-up: channels, the first registration
        for source in sources.values():
            await source.fetch(await publish(writer_stub, contents[-1]))
        for i in range(args.rounds * len(WAYS)):
            way = WAYS[i % len(WAYS)]
            adapter_id = await publish(writer_stub, contents[i])
            missed = await misses(other_stub) + await misses(writer_stub)
            cpu = time.process_time()
            started = time.perf_counter()
            await sources[way].fetch(adapter_id, just_published=way == "just_published")
            results[way]["wall_ms"].append(1000 * (time.perf_counter() - started))
            results[way]["cpu_ms"].append(1000 * (time.process_time() - cpu))
            results[way]["misses"].append(await misses(other_stub) + await misses(writer_stub) - missed)
        for source in sources.values():
            await source.close()
        for channel in channels:
            await channel.close()
    finally:
        for host in hosts:
            await host.shutdown()
        etcd.stop()
    return {
        way: {
            "fetches": len(r["wall_ms"]),
            "wall_p50_ms": round(statistics.median(r["wall_ms"]), 1),
            "wall_max_ms": round(max(r["wall_ms"]), 1),
            "cpu_p50_ms": round(statistics.median(r["cpu_ms"]), 1),
            "cpu_min_ms": round(min(r["cpu_ms"]), 1),
            "blob_reads": int(sum(r["misses"])),
        }
        for way, r in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="fetches of each way")
    parser.add_argument(
        "--rank", type=int, default=16, help="the adapter's rank (16: 9.8 MB on all seven projections)"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lm-fetch-ab-") as tmp:
        ways = asyncio.run(run(args, Path(tmp)))
    print(
        json.dumps(
            {
                "rank": args.rank,
                "cpus": os.cpu_count(),
                "load_before": [round(v, 2) for v in load_before],
                "load_after": [round(v, 2) for v in os.getloadavg()],
                "ways": ways,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
