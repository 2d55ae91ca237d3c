"""``Worker/Prefetch``: each distinct adapter named starts one pull, and a call naming more than
:data:`MAX_PREFETCH_ADAPTERS` is refused before any starts (3,000 at once held the worker's event
loop for seconds: the fuzz campaign, docs/security.md)."""

from __future__ import annotations

import pytest
from support.polling import poll_until
from test_adapter_loader import make_loader, source_files  # noqa: F401  (the fixture)

from mesh_api.v1 import worker_pb2
from services.gpu_worker.servicer import MAX_PREFETCH_ADAPTERS, WorkerServicer
from services.runtime.errors import InvalidArgument


@pytest.fixture
def servicer(tiny_llama, source_files):  # noqa: F811
    loader = make_loader(tiny_llama, source_files, None)
    servicer = WorkerServicer()
    servicer.attach(loader.engine, loader, {})
    return servicer


async def test_a_repeated_adapter_is_pulled_once(servicer):
    reply = await servicer.Prefetch(worker_pb2.PrefetchRequest(adapter_ids=["a0"] * 3000 + ["a1"]), None)
    assert list(reply.started) == ["a0", "a1"]
    engine = servicer.loader.engine

    async def held():
        return [a for a in ("a0", "a1") if engine.has_adapter(a)]

    await poll_until(held, lambda ids: len(ids) == 2, "both prefetched adapters on the worker")
    assert sorted(servicer.loader.source.fetched) == ["a0", "a1"]


async def test_too_many_adapters_are_refused_before_any_pull(servicer):
    ids = [f"x{i}" for i in range(MAX_PREFETCH_ADAPTERS + 1)]
    with pytest.raises(InvalidArgument, match=f"names {MAX_PREFETCH_ADAPTERS + 1} adapters: at most"):
        await servicer.Prefetch(worker_pb2.PrefetchRequest(adapter_ids=ids), None)
    assert servicer.loader.source.fetched == []
