"""The gateway's adapter catalog: lookups cached and bounded (past its size the least recently
used entries go, through the runtime's eviction interface, and what was dropped is asked of the
store again), and dropped as soon as the store's watch reports a change to their name."""

from __future__ import annotations

import asyncio
import re

from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.adapter_index import IndexTimeouts
from services.gateway.adapter_reference import ResolvedAdapter


class CountingStore:
    """Any name is an adapter of its owner; lookups are recorded; the watch is fed by the test."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.versions: dict[tuple[str, str], int] = {}
        self.changes: asyncio.Queue[adapter_store_pb2.WatchAdaptersResponse] = asyncio.Queue()

    async def get(self, owner: str, name: str) -> types_pb2.AdapterInfo:
        self.asked.append((owner, name))
        version = self.versions.get((owner, name), 1)
        return types_pb2.AdapterInfo(id=f"{owner}/{name}@{version}", owner=owner, name=name, version=version)

    async def get_id(self, adapter_id: str) -> types_pb2.AdapterInfo:
        owner, name, version = re.fullmatch(r"(.*)/(.*)@(\d+)", adapter_id).groups()
        return types_pb2.AdapterInfo(id=adapter_id, owner=owner, name=name, version=int(version))

    async def ListAdapters(self, request):
        raise AssertionError("not listed by page here")

    async def watch(self, refresh: bool):
        while True:
            yield await self.changes.get()


async def test_the_cache_keeps_at_most_max_entries_least_recently_used_out_first():
    store = CountingStore()
    catalog = AdapterCatalog(store, ttl_s=3600, max_entries=10)
    await catalog.resolve("t", "hot")
    for i in range(25):
        await catalog.resolve("t", f"a{i}")
        await catalog.resolve("t", "hot")  # used all along: never the one to go
        assert len(catalog) <= 10
    assert store.asked.count(("t", "hot")) == 1
    store.asked.clear()
    await catalog.resolve("t", "a24")  # recent: still cached
    await catalog.resolve("t", "a0")  # long unused: dropped, asked again
    assert store.asked == [("t", "a0")]


def test_the_cache_size_is_the_gateways_adapter_access_cache_flag():
    from services.gateway.adapter_catalog import DEFAULT_MAX_ENTRIES
    from services.gateway.config import GatewayConfig
    from services.runtime.config import parse_config

    assert parse_config(GatewayConfig, []).adapter_access_cache == DEFAULT_MAX_ENTRIES
    assert parse_config(GatewayConfig, ["--adapter-access-cache", "12"]).adapter_access_cache == 12


async def test_a_change_the_watch_reports_drops_the_cached_lookup_of_its_name():
    store = CountingStore()
    catalog = AdapterCatalog(store, ttl_s=3600, timeouts=IndexTimeouts(retry_s=0))
    first = await catalog.resolve("alice", "tuned")
    assert first == ResolvedAdapter(
        id="alice/tuned@1", owner="alice", name="tuned", public=False, sha256="", version=1,
        created_s=0, chat_template="", tool_use_chat_template="",
    )  # fmt: skip
    # Another gateway registers a new version of the name: the watch brings it.
    store.versions[("alice", "tuned")] = 2
    new = types_pb2.AdapterInfo(id="alice/tuned@2", owner="alice", name="tuned", version=2)
    catalog.start()
    await store.changes.put(adapter_store_pb2.WatchAdaptersResponse(upserted=[new], synced=True))
    assert [a.id for a in await catalog.usable("alice")] == ["alice/tuned@2"]
    assert (await catalog.resolve("alice", "tuned")).version == 2
    # ...and deletes it: the next lookup asks the store again.
    asked = len(store.asked)
    await store.changes.put(adapter_store_pb2.WatchAdaptersResponse(deleted_ids=["alice/tuned@2"]))
    await catalog.shows("alice/tuned@2", present=False)
    assert await catalog.usable("alice") == []
    await catalog.resolve("alice", "tuned")
    assert len(store.asked) == asked + 1
    await catalog.stop()


async def test_the_base_model_resolves_to_no_adapter_without_a_lookup():
    store = CountingStore()
    assert await AdapterCatalog(store).resolve("alice", "") is None
    assert store.asked == []
