"""The DistKV meter over a real creditor's lender (tiny Llama, fp32) reached in process, with an
injected clock: a debtor's attention calls and the creditor's attention compute are timed
exactly, each step's wait is closed by ``end_step``, and other lending calls are not timed."""

from __future__ import annotations

import threading

import torch
from support.in_process_transport import InProcessTransport

from services.gpu_worker.build import local_engine
from services.gpu_worker.distkv.distkv_meter import DistKvMeter, DistKvTotals, MeteredTransport
from services.gpu_worker.distkv.kv_block_allocator import AttendCall, AttendSegment, KvRows
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.model.llama import LlamaModel


class TickingClock:
    """Advances by ``tick`` seconds each time it is read."""

    def __init__(self, tick: float):
        self.tick = tick
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def creditor(tiny_llama) -> Engine:
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32)
    return local_engine(model, EngineConfig(pool_mib=1, worker_id="creditor", max_lent_blocks=4))


def segment(engine: Engine, tiny_llama, block_id: int) -> AttendSegment[int]:
    cfg = tiny_llama.config
    queries = torch.randn(2, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    return AttendSegment(queries, torch.tensor([0, 1]), [block_id], [0])


def test_debtor_attention_is_timed_per_call_and_closed_per_step(tiny_llama):
    lender_engine = creditor(tiny_llama)
    meter = DistKvMeter(clock=TickingClock(0.25))
    waits: list[float] = []
    meter.on_step_wait = waits.append
    transport = MeteredTransport(InProcessTransport("creditor", lender_engine.rm.lender), meter)

    (block,) = transport.allocate("debtor", 1)
    layout = lender_engine.pool.layout
    keys = torch.ones(2, layout.kv_dim)
    transport.write_async("debtor", 0, KvRows([block, block], torch.tensor([0, 1]), keys, keys)).result()
    assert meter.totals() == DistKvTotals()  # only attention is timed
    assert meter.end_step() is None and waits == []  # a step with no remote attention

    for _ in range(3):
        transport.attend("debtor", AttendCall(0, [segment(lender_engine, tiny_llama, block)])).result()
    assert meter.totals().remote_attention_calls == 3
    assert meter.totals().remote_attention_s == 0.75  # each wait read the clock twice
    assert meter.end_step() == 0.75 and waits == [0.75]

    transport.attend("debtor", AttendCall(1, [segment(lender_engine, tiny_llama, block)])).result()
    assert meter.end_step() == 0.25 and waits == [0.75, 0.25]
    assert meter.end_step() is None
    transport.free("debtor", [block])
    assert lender_engine.lending.lent_to() == {}


def test_the_creditor_times_the_attention_it_computes_for_debtors(tiny_llama):
    engine = creditor(tiny_llama)
    engine.distkv.clock = TickingClock(0.5)
    lending = engine.lending
    (block,) = lending.allocate("debtor", 1, engine.pool.layout)
    call = AttendCall(0, [segment(engine, tiny_llama, block)])
    threads = [threading.Thread(target=lending.attend, args=("debtor", call)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    totals = engine.distkv.totals()
    assert (totals.lent_attention_calls, totals.lent_attention_s) == (4, 2.0)
    assert totals.remote_attention_calls == 0  # it lent; it did not borrow
