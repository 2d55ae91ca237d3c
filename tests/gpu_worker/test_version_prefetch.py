"""A published version of a name this worker serves is pulled before any request asks for it,
from the catalog rows' etcd watch (a real etcd): then paged in; one pull per name at a time, the
newest of the versions published meanwhile next; names no request used lately are left alone,
and so are versions published while no request used the name since its last pull ahead."""

from __future__ import annotations

import asyncio
import json

import aetcd
import pytest
import torch
from support.polling import poll_until

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import FetchedAdapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.version_prefetch import VersionPrefetch, follow_publishes
from services.runtime.etcd.adapter_catalog_rows import catalog_rows
from services.runtime.etcd.membership import MembershipConfig

WITHIN_S = 60.0


class VersionsSource:
    """Adapter files by id, each id a version of ``owner/name`` (as the store names them); a
    fetch waits for ``gate`` when one is set (a slow pull)."""

    def __init__(self, files: dict[str, tuple[bytes, bytes]], names: dict[str, str]):
        self.files, self.names = files, names
        self.fetched: list[str] = []
        self.gate: asyncio.Event | None = None

    async def fetch(self, adapter_id: str, just_published: bool = False) -> FetchedAdapter:
        self.fetched.append(adapter_id)
        if self.gate is not None:
            await self.gate.wait()
        return FetchedAdapter(*self.files[adapter_id])

    def public_name(self, adapter_id: str) -> str:
        return self.names[adapter_id]

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def versions(tiny_llama, tmp_path_factory):
    """Versions v1..v4 of alice/policy and o1, o2 of alice/other: six contents."""
    root = tmp_path_factory.mktemp("versions")
    files = {}
    for i, adapter_id in enumerate(("v1", "v2", "v3", "v4", "o1", "o2")):
        written = adapter_files(
            write_peft_adapter(root / adapter_id, tiny_llama.spec, SampleAdapterSpec(rank=4, seed=i))
        )
        files[adapter_id] = (written["adapter_config.json"], written["adapter_model.safetensors"])
    names = {a: "alice/other" if a.startswith("o") else "alice/policy" for a in files}
    return files, names


def make_prefetch(tiny_llama, versions):
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=2)
    )
    clock = Clock()
    loader = AdapterLoader(VersionsSource(*versions), engine, torch.float32, clock=clock)
    preloaded: list[str] = []
    return VersionPrefetch(loader, preloaded.append, WITHIN_S, clock), preloaded, clock


def row(adapter_id: str, version: int, name: str = "policy") -> dict:
    return {"id": adapter_id, "owner": "alice", "name": name, "version": version}


async def serve(loader: AdapterLoader, adapter_id: str) -> None:
    """A request on ``adapter_id``: acquired, then released."""
    await loader.acquire(adapter_id)
    loader.release(adapter_id)


@pytest.mark.integration
async def test_a_row_created_in_etcd_for_a_served_name_is_pulled_and_paged_in(tiny_llama, versions, etcd):
    prefetch, preloaded, clock = make_prefetch(tiny_llama, versions)
    loader = prefetch.loader
    await serve(loader, "v1")
    membership = MembershipConfig(etcd_endpoints=etcd.endpoint)
    rows = catalog_rows(membership.key_prefix)
    listed = asyncio.Event()
    following = asyncio.create_task(follow_publishes(membership, prefetch, listed))
    client = aetcd.Client(*etcd.endpoint.split(":"))
    try:
        await asyncio.wait_for(listed.wait(), 60)

        async def publish(adapter_id: str, version: int, name: str = "policy") -> None:
            await client.put(
                f"{rows}{adapter_id}".encode(), json.dumps(row(adapter_id, version, name)).encode()
            )

        await publish("v2", 2)
        await poll_until(lambda: asyncio.sleep(0, preloaded), lambda p: p == ["v2"], "v2 pulled and paged in")
        assert "v2" in loader.engine.host_adapters and loader.source.fetched == ["v1", "v2"]

        # Served longer ago than WITHIN_S: a new version of it is left to its first request,
        # while a name served just now is pulled (its pull shows the row before was seen).
        clock.now += WITHIN_S + 1
        await serve(loader, "o1")
        await publish("v3", 3)
        await publish("o2", 2, name="other")
        await poll_until(lambda: asyncio.sleep(0, preloaded), lambda p: p == ["v2", "o2"], "o2 pulled")
        assert "v3" not in loader.source.fetched and prefetch.started == ["v2", "o2"]
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await client.close()


async def test_one_pull_per_name_at_a_time_then_the_newest_published_meanwhile(tiny_llama, versions):
    prefetch, preloaded, clock = make_prefetch(tiny_llama, versions)
    loader = prefetch.loader
    await serve(loader, "v1")
    loader.source.gate = asyncio.Event()
    assert prefetch.published(row("v2", 2))
    await poll_until(
        lambda: asyncio.sleep(0, loader.source.fetched), lambda f: "v2" in f, "v2's pull started"
    )
    clock.now += 1
    await serve(loader, "v1")  # the name is used while v2 is pulled: its next versions are wanted
    assert prefetch.published(row("v4", 4)) and prefetch.published(row("v3", 3))  # out of order
    assert prefetch.started == ["v2"]
    loader.source.gate.set()
    await poll_until(lambda: asyncio.sleep(0, preloaded), lambda p: p == ["v2", "v4"], "v2 then v4")
    assert "v3" not in loader.source.fetched
    assert not prefetch.published(row("v4", 4))  # held already
    assert not prefetch.published(row("x1", 1, name="never-served"))


async def test_publishes_with_no_request_between_them_pull_one_version(tiny_llama, versions):
    prefetch, preloaded, clock = make_prefetch(tiny_llama, versions)
    loader = prefetch.loader
    await serve(loader, "v1")
    clock.now += 1
    assert prefetch.published(row("v2", 2))
    await poll_until(lambda: asyncio.sleep(0, preloaded), lambda p: p == ["v2"], "v2 pulled")
    clock.now += 1
    # No request used the name since v2's pull began: v3 is left to its first request.
    assert not prefetch.published(row("v3", 3))
    clock.now += 1
    await serve(loader, "v2")  # a rollout on the version pulled ahead
    clock.now += 1
    assert prefetch.published(row("v4", 4))
    await poll_until(lambda: asyncio.sleep(0, preloaded), lambda p: p == ["v2", "v4"], "v4 pulled")
    assert prefetch.started == ["v2", "v4"] and "v3" not in loader.source.fetched
