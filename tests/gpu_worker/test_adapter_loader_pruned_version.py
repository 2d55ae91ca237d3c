"""A request a worker is serving on an adapter version keeps it to its end, byte-identical, when
newer versions are published meanwhile and the store prunes its version's row and blob
(services/adapter_store/version_retention.py): the worker's loader holds its copy by reference,
and drops it once the last request ends. The store is the real repository on a real etcd, for
the tiny Llama's shapes; the worker's side is its real loader and engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.adapter_store.adapter_record import PRIVATE
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.registrar import AdapterUpload
from services.adapter_store.repository import AdapterKey, AdapterRepository, RepositorySettings
from services.adapter_store.validation import ValidationLimits
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import FetchedAdapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import NotFound
from services.runtime.etcd.membership import MembershipConfig

PROMPT = (5, 6, 7, 8)
TOKENS = 8


class RepositorySource:
    """The worker's adapter source over the store's repository in this process (what the store's
    FetchAdapter reads, without the gRPC hop)."""

    def __init__(self, repository: AdapterRepository):
        self.repository = repository

    async def fetch(self, adapter_id: str, just_published: bool = False) -> FetchedAdapter:
        def read() -> FetchedAdapter:
            record = self.repository.resolve(AdapterKey(id=adapter_id))
            return FetchedAdapter(record.config_json.encode(), bytes(self.repository.read_weights(record)))

        return await asyncio.to_thread(read)

    def public_name(self, adapter_id: str) -> str:
        return adapter_id

    async def close(self) -> None:
        pass


@pytest.fixture
def repository(tiny_llama, tmp_path, etcd):
    repository = AdapterRepository(
        LocalDirectoryBlobs(tmp_path / "blobs"),
        MembershipConfig(etcd_endpoints=etcd.endpoint),
        tiny_llama.spec,
        ValidationLimits(),
        RepositorySettings(keep_versions=2, collect_grace_s=0),
    )
    repository.open()
    yield repository
    repository.close()


def publish(repository, tiny_llama, tmp_path, seed: int):
    directory = write_peft_adapter(
        tmp_path / f"v{seed}", tiny_llama.spec, SampleAdapterSpec(rank=4, seed=seed)
    )
    files = adapter_files(directory)
    upload = AdapterUpload(
        "policy", "alice", PRIVATE, files["adapter_config.json"], files["adapter_model.safetensors"]
    )
    return repository.registrar.register_version(upload).record


def run(engine, request_id: str, adapter_id: str, steps: int | None = None, tokens=None) -> list[int]:
    """Submit (when ``tokens`` is None) and step ``steps`` times, or to the end; the tokens so far."""
    if tokens is None:
        tokens = []
        sampling = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        engine.submit(
            GenerationRequest(request_id, PROMPT, sampling, adapter_id),
            lambda event: tokens.append(event.token_id) if event.token_id is not None else None,
        )
    taken = 0
    while engine.has_work() and (steps is None or taken < steps):
        engine.step()
        taken += 1
    return tokens


@pytest.mark.integration
async def test_a_stream_on_a_pruned_version_finishes_byte_identical_and_then_lets_it_go(
    tiny_llama, tmp_path, repository
):
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32), EngineConfig(pool_mib=4)
    )
    loader = AdapterLoader(RepositorySource(repository), engine, torch.float32, host_budget_bytes=1)
    old = publish(repository, tiny_llama, tmp_path, seed=1)

    await loader.acquire(old.id)
    alone = run(engine, "alone", old.id)
    loader.release(old.id)
    assert not engine.has_adapter(old.id)  # over the budget and unreferenced: dropped

    await loader.acquire(old.id)
    tokens = run(engine, "in-flight", old.id, steps=3)
    assert 0 < len(tokens) < TOKENS
    newer = [publish(repository, tiny_llama, tmp_path, seed) for seed in (2, 3)]  # keeps 2: old goes
    assert [r.version for r in newer] == [2, 3]
    assert repository.collector.collect() >= 1
    assert old.sha256 not in {entry.digest for entry in repository.blobs.listing()}
    with pytest.raises(NotFound):
        repository.resolve(AdapterKey(id=old.id))

    assert run(engine, "in-flight", old.id, tokens=tokens) == alone
    assert engine.has_adapter(old.id)  # still referenced by its request
    loader.release(old.id)
    assert not engine.has_adapter(old.id)
    with pytest.raises(NotFound):  # a new request cannot name a pruned version
        await loader.acquire(old.id)
