"""The gateway's adapter-access cache is bounded: past its size the least recently used entries
go (through the runtime's eviction interface), and what was dropped is asked of the store again."""

from __future__ import annotations

from mesh_api.v1 import types_pb2
from services.gateway.adapter_access import AdapterAccess


async def test_the_cache_keeps_at_most_max_entries_least_recently_used_out_first():
    asked: list[tuple[str, str]] = []

    async def lookup(owner: str, name: str) -> types_pb2.AdapterInfo:
        asked.append((owner, name))
        return types_pb2.AdapterInfo(owner=owner, name=name)

    access = AdapterAccess(lookup, ttl_s=3600, max_entries=10)
    await access.resolve("t", "hot")
    for i in range(25):
        await access.resolve("t", f"a{i}")
        await access.resolve("t", "hot")  # used all along: never the one to go
        assert len(access) <= 10
    assert asked.count(("t", "hot")) == 1
    asked.clear()
    await access.resolve("t", "a24")  # recent: still cached
    await access.resolve("t", "a0")  # long unused: dropped, asked again
    assert asked == [("t", "a0")]


def test_the_cache_size_is_the_gateways_adapter_access_cache_flag():
    from services.gateway.adapter_access import DEFAULT_MAX_ENTRIES
    from services.gateway.config import GatewayConfig
    from services.runtime.config import parse_config

    assert parse_config(GatewayConfig, []).adapter_access_cache == DEFAULT_MAX_ENTRIES
    assert parse_config(GatewayConfig, ["--adapter-access-cache", "12"]).adapter_access_cache == 12
