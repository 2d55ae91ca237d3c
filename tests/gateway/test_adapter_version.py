"""Which version of an adapter a reference names (issue 52): ``name``, ``name@N``,
``name@sha256:<hex>`` (whole or a unique prefix of at least 12 hex digits), resolved by the
gateway's catalog from its watched index of every version, the store's newest answer when the
index does not hold it yet; and the fingerprint a response names the version with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.gateway.adapter_catalog import AdapterCatalog
from services.gateway.adapter_index import AdapterIndex, IndexTimeouts
from services.gateway.adapter_reference import ResolvedAdapter
from services.gateway.adapter_version import (
    LATEST,
    VersionSelector,
    fingerprint,
    pick_version,
    split_version,
)
from services.runtime.errors import InvalidArgument, NotFound

DIGEST_1 = "ab" * 32
DIGEST_2 = "ab" * 6 + "cd" * 26  # shares its first 12 hex digits with DIGEST_1
DIGEST_3 = "ef" * 32


def version(owner: str, name: str, number: int, sha256: str, visibility=types_pb2.VISIBILITY_PRIVATE):
    return types_pb2.AdapterInfo(
        id=f"{owner}-{name}-{number}", owner=owner, name=name, version=number, sha256=sha256,
        visibility=visibility,
    )  # fmt: skip


def test_references_split_into_a_name_and_a_version():
    assert split_version("tuned") == ("tuned", LATEST)
    assert split_version("bob/tuned") == ("bob/tuned", LATEST)
    assert split_version("tuned@7") == ("tuned", VersionSelector(number=7))
    assert split_version("bob/tuned@sha256:" + DIGEST_1.upper()) == (
        "bob/tuned",
        VersionSelector(digest=DIGEST_1),
    )
    assert split_version("tuned@sha256:" + DIGEST_1[:12]) == ("tuned", VersionSelector(digest=DIGEST_1[:12]))
    for bad in ("tuned@", "tuned@0", "tuned@v2", "tuned@sha256:" + DIGEST_1[:11], "tuned@sha256:xyz",
                "@3", "tuned@1@2", "tuned@sha256:" + DIGEST_1 + "00"):  # fmt: skip
        with pytest.raises(InvalidArgument, match="a version is '@N'"):
            split_version(bad)


@dataclass(frozen=True)
class V:
    version: int
    sha256: str


def test_a_version_is_picked_by_number_or_by_content():
    versions = [V(1, DIGEST_1), V(2, DIGEST_3), V(3, DIGEST_1)]  # 3 rolled back to 1's content
    assert pick_version(versions, VersionSelector(number=2), "t@2") == V(2, DIGEST_3)
    assert pick_version(versions, VersionSelector(number=4), "t@4") is None
    assert pick_version(versions, VersionSelector(digest=DIGEST_1), "t") == V(3, DIGEST_1)  # the newest
    assert pick_version(versions, VersionSelector(digest=DIGEST_3[:12]), "t") == V(2, DIGEST_3)
    assert pick_version(versions, VersionSelector(digest=DIGEST_2), "t") is None
    with pytest.raises(InvalidArgument, match="matches 2 versions' contents; give more hex digits"):
        pick_version([*versions, V(4, DIGEST_2)], VersionSelector(digest=DIGEST_1[:12]), "t")


def test_the_fingerprint_names_the_version_as_its_caller_would():
    adapter = ResolvedAdapter.of(version("alice", "tuned", 3, DIGEST_3, types_pb2.VISIBILITY_PUBLIC))
    assert fingerprint("alice", adapter) == "tuned@3 sha256:efefefefefef"
    assert fingerprint("bob", adapter) == "alice/tuned@3 sha256:efefefefefef"


class VersionedStore:
    """Versions kept by the test, the newest of a name served by name, any by id; the watch is
    every version, then changes the test queues."""

    def __init__(self, adapters: list[types_pb2.AdapterInfo]) -> None:
        self.adapters = adapters
        self.changes: asyncio.Queue[adapter_store_pb2.WatchAdaptersResponse] = asyncio.Queue()
        self.by_id_asked: list[str] = []

    async def get(self, owner: str, name: str) -> types_pb2.AdapterInfo:
        versions = [a for a in self.adapters if (a.owner, a.name) == (owner, name)]
        if not versions:
            raise NotFound(f"adapter {name!r} of owner {owner!r} not found")
        return max(versions, key=lambda a: a.version)

    async def get_id(self, adapter_id: str) -> types_pb2.AdapterInfo:
        self.by_id_asked.append(adapter_id)
        return next(a for a in self.adapters if a.id == adapter_id)

    async def ListAdapters(self, request):
        raise AssertionError("not listed by page here")

    async def watch(self, refresh: bool):
        yield adapter_store_pb2.WatchAdaptersResponse(upserted=list(self.adapters), synced=True)
        while True:
            yield await self.changes.get()


async def test_the_catalog_resolves_each_version_and_names_a_missing_one():
    store = VersionedStore([
        version("alice", "tuned", 1, DIGEST_1),
        version("alice", "tuned", 2, DIGEST_3),
        version("bob", "open", 1, DIGEST_1, types_pb2.VISIBILITY_PUBLIC),
        version("bob", "closed", 1, DIGEST_1),
    ])  # fmt: skip
    catalog = AdapterCatalog(store, ttl_s=3600, timeouts=IndexTimeouts(retry_s=0))
    try:
        assert (await catalog.resolve("alice", "tuned")).id == "alice-tuned-2"
        assert (await catalog.resolve("alice", "tuned@1")).id == "alice-tuned-1"
        assert (await catalog.resolve("alice", "tuned@sha256:" + DIGEST_3[:16])).id == "alice-tuned-2"
        assert (await catalog.resolve("alice", "bob/open@sha256:" + DIGEST_1)).id == "bob-open-1"
        await catalog.resolve("alice", "tuned@1")
        assert store.by_id_asked == ["alice-tuned-1", "alice-tuned-2", "bob-open-1"]  # cached
        with pytest.raises(NotFound, match="adapter 'tuned' of owner 'alice' has no version 3"):
            await catalog.resolve("alice", "tuned@3")
        with pytest.raises(NotFound, match=f"has no version sha256:{DIGEST_2}"):
            await catalog.resolve("alice", "tuned@sha256:" + DIGEST_2)
        with pytest.raises(NotFound, match="adapter 'nothing' of owner 'alice' has no version 1"):
            await catalog.resolve("alice", "nothing@1")
        with pytest.raises(NotFound, match="adapter 'closed' of owner 'bob' not found"):
            await catalog.resolve("alice", "bob/closed@1")  # private: as if it did not exist

        # A version committed a moment ago, before the watch brings it: the store's newest is it.
        store.adapters.append(version("alice", "tuned", 3, DIGEST_2))
        assert (await catalog.resolve("alice", "tuned@3")).id == "alice-tuned-3"
        # The watch brings it: the digest prefix both contents start with is now ambiguous.
        await store.changes.put(
            adapter_store_pb2.WatchAdaptersResponse(upserted=[store.adapters[-1]], synced=True)
        )
        await catalog.shows("alice-tuned-3", present=True)
        with pytest.raises(InvalidArgument, match="give more hex digits"):
            await catalog.resolve("alice", "tuned@sha256:" + DIGEST_1[:12])
        assert [a.id for a in await catalog.usable("alice")] == ["bob-open-1", "alice-tuned-3"]
    finally:
        await catalog.stop()


async def test_listings_show_each_names_newest_version_and_the_next_newest_when_it_goes():
    store = VersionedStore([version("alice", "tuned", 1, DIGEST_1), version("alice", "other", 1, DIGEST_1)])
    index = AdapterIndex(store, IndexTimeouts(retry_s=0))
    index.start()
    try:
        assert [a.id for a in await index.usable("alice")] == ["alice-tuned-1", "alice-other-1"]
        for change in (
            adapter_store_pb2.WatchAdaptersResponse(upserted=[version("alice", "tuned", 2, DIGEST_3)]),
            adapter_store_pb2.WatchAdaptersResponse(upserted=[version("alice", "tuned", 3, DIGEST_2)]),
        ):
            await store.changes.put(change)
        await index.wait_for("alice-tuned-3", present=True)
        assert [a.id for a in await index.usable("alice")] == ["alice-other-1", "alice-tuned-3"]
        found = await index.find("alice", "tuned", VersionSelector(number=2), "tuned@2")
        assert (found.id, found.version, found.sha256) == ("alice-tuned-2", 2, DIGEST_3)
        await store.changes.put(adapter_store_pb2.WatchAdaptersResponse(deleted_ids=["alice-tuned-3"]))
        await index.wait_for("alice-tuned-3", present=False)
        assert {a.id for a in await index.usable("alice")} == {"alice-other-1", "alice-tuned-2"}
        await store.changes.put(
            adapter_store_pb2.WatchAdaptersResponse(deleted_ids=["alice-tuned-2", "alice-tuned-1"])
        )
        await index.wait_for("alice-tuned-1", present=False)
        assert [a.id for a in await index.usable("alice")] == ["alice-other-1"]
        assert await index.find("alice", "tuned", VersionSelector(number=1), "tuned@1") is None
    finally:
        await index.stop()


async def test_a_name_never_resolves_older_than_the_newest_version_the_index_holds():
    store = VersionedStore([version("alice", "tuned", 1, DIGEST_1)])
    catalog = AdapterCatalog(store, ttl_s=3600, timeouts=IndexTimeouts(retry_s=0))
    catalog.start()  # as the gateway does when it starts
    try:
        assert [a.id for a in await catalog.usable("alice")] == ["alice-tuned-1"]
        assert (await catalog.resolve("alice", "tuned")).version == 1
        # The watch brings version 2, but the store's answer by name lags (a replica's mirror
        # behind) and would be cached again: the index's newest version wins.
        newer = version("alice", "tuned", 2, DIGEST_3)
        store.adapters.append(newer)
        stale = store.get

        async def lagging(owner: str, name: str) -> types_pb2.AdapterInfo:
            return store.adapters[0] if (owner, name) == ("alice", "tuned") else await stale(owner, name)

        store.get = lagging
        await store.changes.put(adapter_store_pb2.WatchAdaptersResponse(upserted=[newer]))
        await catalog.shows("alice-tuned-2", present=True)
        assert (await catalog.resolve("alice", "tuned")).id == "alice-tuned-2"
    finally:
        await catalog.stop()
