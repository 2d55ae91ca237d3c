"""DistKV-LLM's compute cap, in process (three tiny-Llama engines, fp32): a creditor over its
``lend_compute_share`` refuses remote attention mid-prefill; the debtor gives the blocks back,
recomputes the request with another creditor's blocks, and its greedy output is the one of a
single big-pool engine; every block is accounted for and both sides count the refusal."""

from __future__ import annotations

import torch
from support.in_process_transport import InProcessTransport

from services.gpu_worker.attention.dist_attention import PartialAttention
from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.kv_block_allocator import AttendCall
from services.gpu_worker.distkv.lend_compute_cap import LendComputeCap
from services.gpu_worker.distkv.remote_block_allocator import Pending, done
from services.gpu_worker.distkv.shared_lender import SharedLender
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.model.llama import LlamaModel
from tests.gpu_worker.engine.test_engine_borrow import Mesh, greedy, reference, run


class ThroughTheLender(InProcessTransport):
    """Attention through the creditor's shared (metered, capped) lender, as its AttendRemote does."""

    def __init__(self, creditor: str, engine: Engine):
        super().__init__(creditor, engine.rm.lender)
        self.shared: SharedLender = engine.lending

    def attend(self, debtor: str, call: AttendCall[int]) -> Pending[list[PartialAttention]]:
        self._reachable()
        return done(lambda: self.shared.attend(debtor, call))


class Ticks:
    """A clock one second further at each read: each admitted call lasts exactly 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_creditor_over_its_cap_refuses_and_the_debtor_recomputes_elsewhere(tiny_llama):
    request = greedy(prompt_len=40, max_tokens=16)  # 14 blocks: 8 local, 6 lent by one creditor
    expected_tokens, _ = reference(tiny_llama, request)
    mesh = Mesh(tiny_llama)
    debtor, busy = mesh.engines["w0"], mesh.engines["w1"]
    for name in ("w1", "w2"):
        mesh.transports[name] = ThroughTheLender(name, mesh.engines[name])
    # w1 (suggested first: the tie on lendable blocks goes to it) lends 1 s of each 10 s and has
    # requests of its own: it serves one attention call, then refuses.
    busy.lending.cap = LendComputeCap(share=0.1, window_s=10.0, clock=Ticks(), busy=lambda: True)
    borrowed_from: list[set[str]] = []
    debtor.on_logits = lambda _, row: borrowed_from.append(set(debtor.rm.accounting().borrowed_blocks))

    assert run(debtor, request) == expected_tokens

    assert busy.lending.cap.refused == 1 and mesh.refusals == ["w1"]
    assert busy.distkv.totals().lent_attention_refused == 1
    assert busy.distkv.totals().lent_attention_calls == 1
    assert debtor.distkv.totals().remote_attention_refused == 1
    assert debtor.preemptions == 1  # recomputed once, nothing lost
    # The prefill attended over its KV in hand and shipped the lent part to w1; w1 refused the
    # first decode step's attention, so every later token attended over w2 only.
    assert borrowed_from[0] == {"w1"} and all(peers == {"w2"} for peers in borrowed_from[1:])
    mesh.assert_every_block_accounted_for()  # w1's blocks were given back, not leaked


def test_the_config_reaches_the_cap_and_an_idle_worker_is_not_capped(tiny_llama):
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    engine = local_engine(model, EngineConfig(lend_compute_share=0.0, lend_compute_window_s=3.0))
    cap = engine.lending.cap
    assert (cap.share, cap.window_s) == (0.0, 3.0)
    cap.done(cap.admit())  # nothing of its own runs or waits: lending costs no SLA
    assert cap.refused == 0
