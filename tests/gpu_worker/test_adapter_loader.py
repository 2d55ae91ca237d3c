"""The worker's adapter loader: one fetch per adapter, reference counts, host RAM budget, the
eviction policy's order, and pins (from the fetch or the whole pinned set) kept on the host and
handed to the engine's pool."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import FetchedAdapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.eviction import LFUEviction


class CountingSource:
    """Serves adapter files from memory and counts fetches (a real AdapterSource is async too)."""

    def __init__(self, files: dict[str, tuple[bytes, bytes]]):
        self.files = files
        self.fetched: list[str] = []
        self.pinned: set[str] = set()
        """What the store would say is pinned when an adapter is fetched."""

    async def fetch(self, adapter_id: str, just_published: bool = False) -> FetchedAdapter:
        self.fetched.append(adapter_id)
        await asyncio.sleep(0.01)
        return FetchedAdapter(*self.files[adapter_id], pinned=adapter_id in self.pinned)

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def source_files(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("loader-adapters")
    files = {}
    for i in range(4):
        directory = write_peft_adapter(root / f"a{i}", tiny_llama.spec, SampleAdapterSpec(rank=8, seed=i))
        written = adapter_files(directory)
        files[f"a{i}"] = (written["adapter_config.json"], written["adapter_model.safetensors"])
    return files


def make_loader(tiny_llama, files, budget: int | None, eviction=None):
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=2)
    )
    return AdapterLoader(CountingSource(files), engine, torch.float32, budget, eviction)


async def test_concurrent_requests_for_one_adapter_fetch_it_once(tiny_llama, source_files):
    loader = make_loader(tiny_llama, source_files, None)
    adapters = await asyncio.gather(*(loader.acquire("a0") for _ in range(8)))
    assert loader.source.fetched == ["a0"] and all(a is adapters[0] for a in adapters)
    for _ in range(8):
        loader.release("a0")
    with pytest.raises(RuntimeError, match="released more often"):
        loader.release("a0")


async def test_budget_drops_unreferenced_adapters_lru_and_refetches_them(tiny_llama, source_files):
    one = (await make_loader(tiny_llama, source_files, None).ensure("a0")).nbytes
    loader = make_loader(tiny_llama, source_files, budget=2 * one)
    await loader.acquire("a0")
    await loader.acquire("a1")
    await loader.acquire("a2")  # over budget, but every copy is referenced: all stay
    assert all(loader.engine.has_adapter(f"a{i}") for i in range(3))
    loader.release("a1")
    assert not loader.engine.has_adapter("a1") and loader.host_bytes == 2 * one
    loader.release("a0")
    loader.release("a2")
    assert loader.host_bytes <= 2 * one
    await loader.acquire("a1")  # dropped earlier: fetched again
    assert loader.source.fetched.count("a1") == 2 and loader.engine.has_adapter("a1")
    assert loader.host_bytes <= 2 * one


async def use(loader, adapter_id: str, times: int = 1) -> None:
    for _ in range(times):
        await loader.acquire(adapter_id)
        loader.release(adapter_id)


async def test_lfu_drops_the_least_used_copy(tiny_llama, source_files):
    one = (await make_loader(tiny_llama, source_files, None).ensure("a0")).nbytes
    loader = make_loader(tiny_llama, source_files, budget=2 * one, eviction=LFUEviction())
    await use(loader, "a0", times=3)
    await use(loader, "a1")
    await use(loader, "a2")  # over budget: a1 (used once, before a2) goes, a0 (3 uses) stays
    assert [loader.engine.has_adapter(f"a{i}") for i in range(3)] == [True, False, True]


async def test_pinned_copies_are_never_dropped_and_pins_reach_the_pool(tiny_llama, source_files):
    one = (await make_loader(tiny_llama, source_files, None).ensure("a0")).nbytes
    loader = make_loader(tiny_llama, source_files, budget=one)
    loader.source.pinned = {"a0"}
    await use(loader, "a0")  # pinned by its fetch
    await use(loader, "a1")  # over budget: a1 is dropped, not the older a0
    assert loader.engine.has_adapter("a0") and not loader.engine.has_adapter("a1")
    loader.source.pinned = {"a0", "a1"}  # a1 pinned at the store since...
    loader.set_pinned({"a0", "a1"})  # ...and the whole pinned set read, as the refresh does
    await use(loader, "a1")
    assert loader.engine.has_adapter("a0") and loader.engine.has_adapter("a1")  # pins beyond the budget
    loader.engine.hand_over.run_calls()  # what the engine thread does between two steps
    assert loader.engine.residency._eviction.pinned() == {"a0", "a1"}
    loader.set_pinned(set())  # unpinned: back within the budget
    assert loader.host_bytes <= one
