"""The cluster prefix tier across real servers: two workers (tiny random Llama, fp32) on loopback,
registered in a real etcd, announcing to a real kv_manager's index.

A prompt prefilled on one worker is fetched by the other instead of recomputed, and gives the
same greedy tokens and log-probabilities; a fetched block is checked against the key asked for;
two adapters with one name and different weights (vLLM #44250's adversarial case) share no
block, on one worker or across the two; a dead holder's entries leave the index with its lease;
a kv_manager that restarted (an empty index) is told each worker's whole set again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from grpc import aio
from support.polling import poll_until

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from mesh_api.v1 import kv_manager_pb2, kv_manager_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from mesh_api.v1.types_pb2 import WorkerLoad
from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.adapter_source import DirectorySource
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.prefix_tier import PrefixTierSettings
from services.gpu_worker.prefix_tier_setup import PrefixTierParts, start_prefix_tier
from services.gpu_worker.servicer import WorkerServicer
from services.gpu_worker.worker_metrics import WorkerMetrics, WorkerParts
from services.kv_manager.config import KVManagerConfig
from services.kv_manager.service import KVManagerService
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.runtime.etcd.worker_load import worker_load_to_report
from services.runtime.prefix_keys import adapter_key_space, prompt_block_keys
from services.runtime.rpc.interceptors import ServiceInterceptor
from services.runtime.rpc.server import start_service
from services.runtime.security.tls import NO_TLS, add_server_port

pytestmark = pytest.mark.integration

BLOCK = 4
IDENTITY = "tiny-llama/float32/none/4"
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(41)]
"""41 tokens: 10 whole blocks, of which the engine may take the first 10 (the last token is
always computed: it is the 41st)."""
USABLE_BLOCKS = (len(PROMPT) - 1) // BLOCK
GREEDY = types_pb2.SamplingParams(max_tokens=8, ignore_eos=True, top_logprobs=0)


@dataclass
class Worker:
    worker_id: str
    engine: Engine
    tier: PrefixTierParts
    server: aio.Server
    stub: worker_pb2_grpc.WorkerStub
    channel: aio.Channel
    registration: MemberRegistration

    async def generate(self, prompt: list[int], adapter: str = "") -> tuple[list[int], list[float], int]:
        tokens, logprobs, cached = [], [], 0
        request = worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=GREEDY, adapter_id=adapter)
        async for reply in self.stub.Generate(request):
            tokens += reply.token_ids
            logprobs += [p.logprob for p in reply.logprobs]
            cached = max(cached, reply.cached_prompt_tokens)
        return tokens, logprobs, cached

    async def stop(self) -> None:
        await self.tier.close()
        await self.registration.stop()
        await self.channel.close()
        await self.server.stop(None)
        self.engine.stop()


@pytest.fixture
async def kv_manager(etcd):
    index = KvManager(etcd.endpoint)
    await index.start("kv-a")
    yield index
    await index.stop()


class KvManager:
    """The real kv_manager, replaceable by a new one (a restart: its index starts empty)."""

    def __init__(self, etcd_endpoint: str):
        self.etcd_endpoint = etcd_endpoint
        self.address = ""
        self.stub: kv_manager_pb2_grpc.KVManagerStub | None = None
        self._running = None

    async def start(self, instance_id: str) -> None:
        config = KVManagerConfig(
            etcd_endpoints=self.etcd_endpoint,
            lease_ttl_s=2,
            grace_s=0.5,
            instance_id=instance_id,
            dgfm_interval_s=0,
        )
        host = await start_service(KVManagerService(config), config)
        channel = aio.insecure_channel(host.address)
        self._running, self.address = (host, channel), host.address
        self.stub = kv_manager_pb2_grpc.KVManagerStub(channel)

    async def stop(self) -> None:
        host, channel = self._running
        await channel.close()
        await host.shutdown()


@pytest.fixture
async def mesh(etcd, kv_manager, tiny_llama):
    started: list[Worker] = []

    async def start(worker_id: str, adapter_dir: Path | None = None) -> Worker:
        """``adapter_dir``: the PEFT adapters it serves, one directory per id."""
        model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
        engine = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK, prefix_cache=True))
        engine.start()
        loader = AdapterLoader(DirectorySource(adapter_dir), engine, torch.float32) if adapter_dir else None
        # A prefill rate this low makes every fetch cheaper than computing: the tiny model's
        # real prefill is faster than any round trip, which the cost model would rightly prefer.
        tier = start_prefix_tier(
            engine,
            PrefixTierSettings(worker_id, IDENTITY, announce_interval_s=0.02),
            lambda: (kv_manager.address,),
            prefix_fetch_mb_s=400.0,
            prefill_gflops=1e-6,
        )
        servicer = WorkerServicer()
        servicer.attach(engine, loader, {"model": "tiny-llama", "dtype": "float32"})
        servicer.prefix_tier = tier.tier
        server = aio.server(interceptors=[ServiceInterceptor()])
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        address = f"127.0.0.1:{add_server_port(server, '127.0.0.1:0', NO_TLS)}"
        await server.start()
        registration = MemberRegistration(
            MembershipConfig(etcd_endpoints=etcd.endpoint, ttl_s=2, load_interval_s=0.2),
            MemberInfo.create("gpu_worker", address, instance_id=worker_id),
            load_fn=lambda: worker_load_to_report(WorkerLoad(total_blocks=8)),
        )
        await registration.start()
        channel = aio.insecure_channel(address)
        worker = Worker(
            worker_id, engine, tier, server, worker_pb2_grpc.WorkerStub(channel), channel, registration
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.stop()


def keys_of(prompt: list[int], adapter_space: bytes | None = None) -> list[bytes]:
    return prompt_block_keys("", prompt, BLOCK, adapter_space)[:USABLE_BLOCKS]


async def holder_of(kv_manager, keys: list[bytes]) -> kv_manager_pb2.LocatePrefixResponse:
    request = kv_manager_pb2.LocatePrefixRequest(worker_id="a-test", kv_identity=IDENTITY, keys=keys)
    return await kv_manager.stub.LocatePrefix(request)


async def test_a_prefix_fetched_from_another_worker_gives_the_recomputed_tokens(mesh, kv_manager):
    a, b = await mesh("gpu_worker-a"), await mesh("gpu_worker-b")
    computed, computed_logprobs, cached = await a.generate(PROMPT)
    assert cached == 0
    found = await poll_until(
        lambda: holder_of(kv_manager, keys_of(PROMPT)),
        lambda r: r.blocks == USABLE_BLOCKS,
        "the index places the prompt's blocks on worker a",
    )
    assert found.holder_id == "gpu_worker-a"

    fetched, fetched_logprobs, cached = await b.generate(PROMPT)
    assert cached == USABLE_BLOCKS * BLOCK  # all but the last token's block came from a
    counters = b.tier.tier.counters
    assert (counters.fetched_blocks, counters.tokens_saved, counters.rejected_blocks) == (10, 40, 0)
    assert fetched == computed
    assert fetched_logprobs == pytest.approx(computed_logprobs, abs=1e-5)
    metrics = WorkerMetrics(lambda: WorkerParts(b.engine, None, "tiny-llama"))
    metrics.prefix_tier = b.tier.tier
    series = {s.name: s.value for family in metrics.collect() for s in family.samples}
    assert series["loramesh_gpu_worker_prefix_tier_fetched_blocks_total"] == 10
    assert series["loramesh_gpu_worker_prefix_tier_tokens_saved_total"] == 40

    # a longer prompt: b now holds the prefix itself (local hits), and fetches nothing more
    longer = [*PROMPT, 5, 6, 7, 8, 9]
    await b.generate(longer)
    assert counters.fetched_blocks == 10 and counters.local_hit_blocks == 10


async def test_a_block_under_another_key_is_refused_and_the_prompt_recomputed(mesh, kv_manager):
    a, b = await mesh("gpu_worker-a"), await mesh("gpu_worker-b")
    await a.generate(PROMPT)
    await poll_until(
        lambda: holder_of(kv_manager, keys_of(PROMPT)),
        lambda r: r.blocks == USABLE_BLOCKS,
        "the index places the prompt's blocks on worker a",
    )
    honest = b.tier.tier.peers.fetch

    async def lying(address, identity, keys, deadline_s):  # a holder answering under swapped keys
        blocks = await honest(address, identity, keys, deadline_s)
        return [(blocks[1][0], blocks[0][1]), *blocks[1:]]

    b.tier.tier.peers.fetch = lying
    _, _, cached = await b.generate(PROMPT)
    counters = b.tier.tier.counters
    assert (counters.fetched_blocks, counters.rejected_blocks, cached) == (0, 10, 0)


async def test_two_adapters_of_one_name_and_different_weights_share_no_block(
    mesh, kv_manager, tiny_llama, tmp_path
):
    """vLLM #44250: the same prompt under three adapters all named 'twin', with different
    weights: one after the other on worker a, then a third on worker b."""
    samples = {seed: SampleAdapterSpec(scale=0.2, seed=seed) for seed in (1, 2, 3)}
    dirs = {
        seed: write_peft_adapter(tmp_path / str(seed) / "twin", tiny_llama.spec, s)
        for seed, s in samples.items()
    }
    twins = {seed: read_peft_directory("twin", path, torch.float32) for seed, path in dirs.items()}
    assert len({twin.content_sha256 for twin in twins.values()}) == 3
    a = await mesh("gpu_worker-a", tmp_path / "1")
    await a.generate(PROMPT, adapter="twin")
    a.engine.remove_adapter("twin")  # the other twin under the same name, on the same worker
    a.engine.add_adapter(twins[2])
    _, _, cached = await a.generate(PROMPT, adapter="twin")
    assert cached == 0 and a.engine.prefix_cache.stats().hit_blocks == 0  # locally: no hit
    for twin in (twins[1], twins[2]):  # the index knows both of a's twins' blocks before b asks
        keys = keys_of(PROMPT, adapter_key_space("twin", twin.content_sha256))
        await poll_until(
            lambda keys=keys: holder_of(kv_manager, keys),
            lambda r: r.holder_id == "gpu_worker-a" and r.blocks == USABLE_BLOCKS,
            "the index places a's twin blocks on a",
        )

    b = await mesh("gpu_worker-b", tmp_path / "3")
    _, _, cached = await b.generate(PROMPT, adapter="twin")
    counters = b.tier.tier.counters
    assert cached == 0 and (counters.remote_hit_blocks, counters.fetched_blocks) == (0, 0)  # remotely: none


async def test_a_dead_holder_leaves_the_index_with_its_lease(mesh, kv_manager):
    a = await mesh("gpu_worker-a")
    await a.generate(PROMPT)
    await poll_until(
        lambda: holder_of(kv_manager, keys_of(PROMPT)),
        lambda r: r.holder_id == "gpu_worker-a",
        "the index places the prompt on a",
    )
    await a.registration.stop()  # as its lease expiring does: the member key goes
    await poll_until(
        lambda: holder_of(kv_manager, keys_of(PROMPT)), lambda r: not r.holder_id, "a's entries are gone"
    )


async def test_a_new_kv_manager_is_told_the_whole_set_again(mesh, kv_manager):
    a = await mesh("gpu_worker-a")
    await a.generate(PROMPT)
    await poll_until(
        lambda: holder_of(kv_manager, keys_of(PROMPT)),
        lambda r: r.holder_id == "gpu_worker-a",
        "the index places the prompt on a",
    )
    await kv_manager.stop()
    await kv_manager.start("kv-b")  # empty: it learns a's blocks only from a full announcement
    found = await poll_until(
        lambda: holder_of(kv_manager, keys_of(PROMPT)),
        lambda r: r.holder_id == "gpu_worker-a",
        "the new index places the prompt on a",
    )
    assert found.blocks == USABLE_BLOCKS and a.tier.tier.index_id.startswith("kv-b/")
