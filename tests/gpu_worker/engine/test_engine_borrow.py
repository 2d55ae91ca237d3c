"""``kv_overflow="borrow"`` on three engines in one process (tiny random Llama, fp32): a prompt
longer than the debtor's pool borrows blocks from both other workers, prefills and decodes with
its KV on all three, and produces the greedy tokens and logits of one engine with a big pool; a
request that starts local and crosses the pool's end while decoding too; a creditor that dies
mid-generation costs a recompute and nothing else; every block is accounted for afterwards."""

from __future__ import annotations

import pytest
import torch
from support.in_process_transport import InProcessTransport

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import FailedPrecondition, ResourceExhausted

BLOCK = 4
SMALL_POOL_MIB = (
    1 / 64
)  # tiny Llama: 1 KiB pages (4 tokens × kv_dim 32 × K,V fp32), 16 pages = 8 blocks of 2 layers
CAP = 6


class Mesh:
    """Three engines; each suggests the others as creditors, the most lendable first."""

    def __init__(self, tiny_llama):
        self.engines: dict[str, Engine] = {}
        self.transports: dict[str, InProcessTransport] = {}
        self.refusals: list[str] = []
        for name in ("w0", "w1", "w2"):
            model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
            config = EngineConfig(
                pool_mib=SMALL_POOL_MIB,
                kv_block_tokens=BLOCK,
                worker_id=name,
                max_lent_blocks=CAP,
                kv_overflow="borrow",
            )
            self.engines[name] = local_engine(model, config, creditors=self, connect=self._connect)
            self.transports[name] = InProcessTransport(name, self.engines[name].rm.lender)

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        candidates = [
            Candidate(
                name,
                name,
                min(e.rm.lender.config.max_lent_blocks - e.rm.lender.lent_blocks, e.rm.local.free_blocks),
            )
            for name, e in self.engines.items()
            if name != debtor and self.transports[name].alive and name not in self.refusals
        ]
        candidates = [c for c in candidates if c.lendable_blocks > 0]
        if not candidates:
            raise ResourceExhausted("nobody can lend")
        return sorted(candidates, key=lambda c: -c.lendable_blocks)[:3]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        self.refusals.append(creditor)

    def _connect(self, creditor: str, address: str) -> InProcessTransport:
        return self.transports[creditor]

    def assert_every_block_accounted_for(self) -> None:
        for name, engine in self.engines.items():
            accounting = engine.rm.accounting()
            assert accounting.borrowed_blocks == {}, name
            assert accounting.lent_blocks == {}, name
            layout = engine.pool.layout
            # Prompt blocks left in the prefix cache with no request using them are evictable.
            cached = engine.prefix_cache.evictable_pages() if engine.prefix_cache is not None else 0
            assert engine.pool.usage().free_pages + cached == layout.num_pages, name


def run(engine: Engine, request: GenerationRequest, logits: dict | None = None) -> list[int]:
    tokens: list[int] = []
    finish = []

    def sink(event):
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            finish.append(event.finish_reason)

    engine.submit(request, sink)
    while engine.has_work():
        engine.step()
    assert finish == [FinishReason.LENGTH]
    return tokens


def greedy(prompt_len: int, max_tokens: int) -> GenerationRequest:
    prompt = tuple((11 * j + 5) % 250 + 1 for j in range(prompt_len))
    return GenerationRequest("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def reference(tiny_llama, request: GenerationRequest) -> tuple[list[int], list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(
        model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK), on_logits=lambda _, row: logits.append(row)
    )
    return run(engine, request), logits


def test_a_prompt_longer_than_the_pool_borrows_from_both_others_and_matches_one_big_pool(tiny_llama):
    request = greedy(prompt_len=60, max_tokens=16)  # 76 tokens = 19 blocks; 8 local, 6 + 5 lent
    expected_tokens, expected_logits = reference(tiny_llama, request)
    mesh = Mesh(tiny_llama)
    debtor = mesh.engines["w0"]
    logits: list[torch.Tensor] = []
    spread: list[dict] = []
    debtor.on_logits = lambda _, row: (
        logits.append(row),
        spread.append(debtor.rm.accounting().borrowed_blocks),
    )
    assert run(debtor, request) == expected_tokens
    assert len(logits) == len(expected_logits)
    for step, (got, want) in enumerate(zip(logits, expected_logits)):
        assert torch.allclose(got, want, atol=1e-4, rtol=0), f"step {step}: {(got - want).abs().max()}"
    assert set(spread[-1]) == {"w1", "w2"} and sum(spread[-1].values()) == 19 - 8
    assert debtor.preemptions == 0
    mesh.assert_every_block_accounted_for()


def test_a_request_that_starts_local_borrows_when_decoding_crosses_the_pool_end(tiny_llama):
    request = greedy(prompt_len=20, max_tokens=30)  # starts in 5 local blocks, ends in 13
    expected_tokens, _ = reference(tiny_llama, request)
    mesh = Mesh(tiny_llama)
    debtor = mesh.engines["w0"]
    spread: list[dict] = []
    debtor.on_logits = lambda _, row: spread.append(debtor.rm.accounting().borrowed_blocks)
    assert run(debtor, request) == expected_tokens
    assert spread[0] == {} and sum(spread[-1].values()) == 13 - 8
    assert debtor.preemptions == 0  # its local KV stayed where it was
    mesh.assert_every_block_accounted_for()


def test_a_creditor_that_dies_mid_generation_costs_a_recompute_not_the_output(tiny_llama):
    request = greedy(prompt_len=40, max_tokens=16)  # 14 blocks: 8 local, 6 lent by one creditor
    expected_tokens, _ = reference(tiny_llama, request)
    mesh = Mesh(tiny_llama)
    debtor = mesh.engines["w0"]
    killed: list[str] = []

    def kill_a_creditor_after_three_tokens(_, row):
        borrowed = debtor.rm.accounting().borrowed_blocks
        if not killed and len(debtor.running[0].output_ids) == 3 and borrowed:
            killed.append(min(borrowed))
            mesh.transports[killed[0]].kill()

    debtor.on_logits = kill_a_creditor_after_three_tokens
    assert run(debtor, request) == expected_tokens
    assert killed and debtor.preemptions == 1
    assert debtor.rm.accounting().borrowed_blocks == {}
    mesh.engines[killed[0]].rm.debtor_died("w0")  # what its lease expiry does on the dead side
    mesh.assert_every_block_accounted_for()


@pytest.mark.parametrize("policy", ["preempt", "borrow"])
def test_the_policy_is_checked(tiny_llama, policy):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    if policy == "borrow":
        with pytest.raises(ValueError, match="needs a creditor directory"):
            local_engine(model, EngineConfig(kv_overflow=policy))
    else:
        assert local_engine(model, EngineConfig(kv_overflow=policy)).borrower is None
    with pytest.raises(ValueError, match="kv_overflow must be one of"):
        EngineConfig(kv_overflow="steal")


class HopelessDirectory:
    """A gManager that knows the other workers would never lend enough together."""

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        raise FailedPrecondition(f"{debtor!r} needs {blocks} KV blocks more than its pool; the others lend 6")

    def report_refusal(self, debtor: str, creditor: str) -> None:
        pass


def test_a_prompt_beyond_what_the_mesh_ever_lends_is_refused_at_once_not_kept_waiting(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    config = EngineConfig(
        pool_mib=SMALL_POOL_MIB, kv_block_tokens=BLOCK, worker_id="w0", kv_overflow="borrow"
    )
    engine = local_engine(
        model, config, creditors=HopelessDirectory(), connect=lambda creditor, address: None
    )
    events = []
    engine.submit(greedy(prompt_len=60, max_tokens=4), events.append)
    for _ in range(3):  # a bound, not a clock: it is refused in the first step
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
    (last,) = [e for e in events if e.finish_reason is not None]
    assert last.finish_reason is FinishReason.ERROR and not [e for e in events if e.token_id is not None]
    assert "do not fit in this worker's pool, nor in what the other workers lend" in last.error
    assert "the others lend 6" in last.error
    assert engine.pool.usage().free_pages == engine.pool.layout.num_pages  # nothing kept
