"""DGFM's test mesh: three borrowing engines over a tiny random Llama (fp32) whose debts form one
cycle, w0 -> w1 -> w2 -> w0, built with every pool full (tests/gpu_worker/engine/test_engine_dgfm.py,
tests/gpu_worker/test_worker_leader_fencing_grpc.py)."""

from __future__ import annotations

import threading

import torch
from support.in_process_transport import InProcessTransport

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.borrower import Candidate
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import FinishReason, GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.runtime.errors import ResourceExhausted

BLOCK = 8
POOL_MIB = 1 / 32
"""Tiny Llama, fp32: a page is 8 tokens × kv_dim 32 × K,V × 4 B = 2 KiB; 16 pages = 8 blocks."""
POOL_BLOCKS = 8
CAP = 6
CREDITOR_OF = {"w0": "w1", "w1": "w2", "w2": "w0"}
"""Each worker borrows from one other only: the debts form the cycle w0 -> w1 -> w2 -> w0."""
PROMPT = 57
"""57 tokens = 8 blocks: 6 in the debtor's pool (2 of its 8 hold another's loan), 2 borrowed."""
MAX_TOKENS = 8
"""57 + 8 tokens fit the 8 blocks (the last token's KV is never written)."""


class CycleMesh:
    """Three borrowing engines; ``w`` borrows only from ``CREDITOR_OF[w]``."""

    def __init__(self, tiny_llama):
        self.engines: dict[str, Engine] = {}
        self.transports: dict[str, InProcessTransport] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        for name in CREDITOR_OF:
            model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
            config = EngineConfig(
                pool_mib=POOL_MIB,
                kv_block_tokens=BLOCK,
                worker_id=name,
                max_lent_blocks=CAP,
                kv_overflow="borrow",
                # The cycle is built block by block: no prompt block may stay cached after its
                # request, where a lender's free pages are counted.
                prefix_cache=False,
            )
            engine = local_engine(
                model,
                config,
                creditors=self,
                connect=lambda creditor, _: self.transports[creditor],
                on_logits=lambda request_id, row: self.logits.setdefault(request_id, []).append(row),
            )
            assert engine.rm.local.free_blocks == POOL_BLOCKS
            self.engines[name] = engine
            self.transports[name] = InProcessTransport(name, engine.rm.lender)

    def suggest(self, debtor: str, blocks: int) -> list[Candidate]:
        lender = self.engines[CREDITOR_OF[debtor]].rm
        lendable = min(CAP - lender.lender.lent_blocks, lender.local.free_blocks)
        if lendable < 1:
            raise ResourceExhausted(f"{CREDITOR_OF[debtor]} cannot lend")
        return [Candidate(CREDITOR_OF[debtor], CREDITOR_OF[debtor], lendable)]

    def report_refusal(self, debtor: str, creditor: str) -> None:
        pass

    def submit(self, worker: str, request: GenerationRequest) -> None:
        def sink(event):
            if event.token_id is not None:
                self.tokens.setdefault(event.request_id, []).append(event.token_id)
            if event.finish_reason is not None:
                self.finish[event.request_id] = event.finish_reason

        self.engines[worker].submit(request, sink)

    def debts(self) -> dict[tuple[str, str], int]:
        """What the ledger would hold: each creditor's loans, as its heartbeat reports them."""
        return {
            (debtor, creditor): blocks
            for creditor, engine in self.engines.items()
            for debtor, blocks in engine.rm.accounting().lent_blocks.items()
        }

    def free_blocks(self) -> dict[str, int]:
        return {name: engine.rm.local.free_blocks for name, engine in self.engines.items()}

    def remote_blocks(self) -> int:
        return sum(sum(e.rm.accounting().borrowed_blocks.values()) for e in self.engines.values())

    def run_to_end(self) -> None:
        while any(e.has_work() for e in self.engines.values()):
            for engine in self.engines.values():
                if engine.has_work():
                    engine.step()


def request(worker: str) -> GenerationRequest:
    offset = int(worker[1:])
    prompt = tuple((7 * j + 13 * offset + 3) % 250 + 1 for j in range(PROMPT))
    return GenerationRequest(f"r-{worker}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def build_full_cycle(mesh: CycleMesh) -> None:
    """Every pool full, each holding 2 blocks of its predecessor's request.

    w1 runs a 2-block filler beside its request, so its request borrows 2 blocks from w2; the
    filler ends, and w2's request (6 blocks left at w2) borrows 2 from w0, whose request then
    takes w0's 6 free blocks and borrows 2 from w1, into the filler's old slots.
    """
    filler = GenerationRequest("filler", tuple(range(1, 10)), SamplingParams(max_tokens=2, ignore_eos=True))
    mesh.submit("w1", filler)
    mesh.submit("w1", request("w1"))
    mesh.engines["w1"].step()  # both prefill; w1's request borrows 2 blocks from w2
    mesh.engines["w1"].step()  # the filler's second token ends it
    assert mesh.finish["filler"] is FinishReason.LENGTH
    for worker in ("w2", "w0"):
        mesh.submit(worker, request(worker))
        mesh.engines[worker].step()
    assert mesh.debts() == {("w0", "w1"): 2, ("w1", "w2"): 2, ("w2", "w0"): 2}
    assert mesh.free_blocks() == {"w0": 0, "w1": 0, "w2": 0}


class SteppedOnCall:
    """Steps ``engine`` once (on a thread of its own) for each call handed to ``between_steps``,
    as the engine thread would, without letting it decode on its own in between."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._hand_over = engine.between_steps
        engine.between_steps = self.between_steps

    def between_steps(self, fn):
        future = self._hand_over(fn)
        threading.Thread(target=self._step, daemon=True).start()
        return future

    def _step(self) -> None:
        with self._lock:
            self.engine.step()
