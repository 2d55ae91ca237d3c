"""Deterministic serving with borrowed KV blocks (tiny random Llama, three engines in one process):
a request whose KV spreads over the debtor and two creditors, attended block by block where each
block lives and combined in block order on the debtor, gets the logits of the same request on one
engine with a big pool, bit for bit, in a prefill longer than the debtor's pool and in decode
steps that cross its end."""

from __future__ import annotations

import pytest
import torch
from support.in_process_transport import InProcessTransport

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.cpu_invariant import invariant_available, invariant_error
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import ResourceExhausted

pytestmark = pytest.mark.skipif(not invariant_available(), reason=f"no native kernels: {invariant_error()}")

BLOCK = 4
SMALL_POOL_MIB = 1 / 64
"""Tiny Llama: 1 KiB pages (4 tokens x kv_dim 32 x K,V fp32), 16 pages = 8 blocks of 2 layers."""


class Lenders:
    """Three deterministic engines; each suggests the others as creditors, most lendable first."""

    def __init__(self, tiny_llama):
        self.engines: dict[str, Engine] = {}
        self.transports: dict[str, InProcessTransport] = {}
        for name in ("w0", "w1", "w2"):
            model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
            config = EngineConfig(
                pool_mib=SMALL_POOL_MIB, kv_block_tokens=BLOCK, worker_id=name, max_lent_blocks=6,
                kv_overflow="borrow", deterministic=True,
            )  # fmt: skip
            self.engines[name] = local_engine(model, config, creditors=self, connect=self._connect)
            self.transports[name] = InProcessTransport(name, self.engines[name].rm.lender)

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        candidates = [
            Candidate(name, name, min(6 - e.rm.lender.lent_blocks, e.rm.local.free_blocks))
            for name, e in self.engines.items()
            if name != debtor
        ]
        candidates = [c for c in candidates if c.lendable_blocks > 0]
        if not candidates:
            raise ResourceExhausted("nobody can lend")
        return sorted(candidates, key=lambda c: -c.lendable_blocks)

    def report_refusal(self, debtor: str, creditor: str) -> None:
        pass

    def _connect(self, creditor: str, address: str) -> InProcessTransport:
        return self.transports[creditor]


def logits_of(engine: Engine, request: GenerationRequest) -> tuple[list[torch.Tensor], list[int]]:
    """The request's logits at each step, and the blocks the engine had borrowed at each."""
    logits: list[torch.Tensor] = []
    borrowed: list[int] = []

    def observe(_, row: torch.Tensor) -> None:
        logits.append(row.clone())
        borrowed.append(sum(engine.rm.accounting().borrowed_blocks.values()))

    engine.on_logits = observe
    engine.submit(request, lambda event: None)
    while engine.has_work():
        engine.step()
    return logits, borrowed


@pytest.mark.parametrize("prompt_len,max_tokens", [(60, 8), (20, 30)])
def test_borrowed_blocks_give_the_bits_of_one_big_pool(tiny_llama, prompt_len, max_tokens):
    prompt = tuple((11 * j + 5) % 250 + 1 for j in range(prompt_len))
    request = GenerationRequest("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    local = local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK, deterministic=True))
    expected, _ = logits_of(local, request)
    debtor = Lenders(tiny_llama).engines["w0"]
    got, borrowed = logits_of(debtor, request)
    assert len(got) == len(expected) == max_tokens
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max():.2e}"
    assert borrowed[-1] > 0 and debtor.preemptions == 0
    if prompt_len < 30:
        assert borrowed[0] == 0  # started local, crossed the pool's end while decoding
