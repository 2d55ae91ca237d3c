"""Three in-process workers lending and borrowing KV blocks: a request's KV spread over all of
them gives exactly the single-place attention, and every block is accounted for through
borrowing, releasing, a creditor dying and a debtor dying."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.in_process_transport import InProcessTransport

from services.gpu_worker.attention.dist_attention import micro_attention
from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.distkv.block_lender import LendingConfig
from services.gpu_worker.distkv.block_table import BlockTable, LocalBlock, RemoteBlock
from services.gpu_worker.distkv.rmanager import RManager, TableQueries
from services.gpu_worker.memory.page_allocator import PoolExhausted
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.runtime.errors import FailedPrecondition, PermissionDenied, ResourceExhausted, Unavailable

BLOCK, KV_HEADS, HEAD_DIM, HEADS, LAYERS = 4, 2, 8, 4, 2
KV_DIM = KV_HEADS * HEAD_DIM
LAYOUT = PoolLayout(
    num_pages=16, kv_block_tokens=BLOCK, kv_dim=KV_DIM, num_layers=LAYERS
)  # 8 blocks a worker
WORKERS = ("w0", "w1", "w2")


class Mesh:
    """Workers whose rManagers reach each other through in-process transports."""

    def __init__(self, cap: int = 6):
        self.workers = {
            w: RManager(
                w, UnifiedPool(PoolView.zeros(LAYOUT, torch.float32)), LendingConfig(max_lent_blocks=cap)
            )
            for w in WORKERS
        }
        self.transports = {w: InProcessTransport(w, rm.lender) for w, rm in self.workers.items()}
        for debtor, rm in self.workers.items():
            for creditor, transport in self.transports.items():
                if creditor != debtor:
                    rm.connect(creditor, transport)

    def restart(self, worker: str) -> None:
        """``worker`` comes back with an empty pool (after the others processed its death)."""
        old = self.workers[worker]
        self.transports[worker].kill()
        rm = RManager(worker, UnifiedPool(PoolView.zeros(LAYOUT, torch.float32)), old.lender.config)
        self.workers[worker] = rm
        self.transports[worker] = InProcessTransport(worker, rm.lender)
        for other, transport in self.transports.items():
            if other != worker:
                rm.connect(other, transport)
                self.workers[other].connect(worker, self.transports[worker])

    def assert_balanced(self, alive=WORKERS) -> None:
        """Every page is free or holds a block used locally or lent; what each debtor thinks it
        borrowed is what each creditor lent it."""
        for w in alive:
            acc = self.workers[w].accounting()
            usage = self.workers[w].local.pool.usage()
            assert usage.kv_pages == LAYERS * (acc.local_blocks + sum(acc.lent_blocks.values()))
            assert usage.free_pages == LAYERS * acc.free_blocks
            for creditor, count in acc.borrowed_blocks.items():
                assert self.workers[creditor].accounting().lent_blocks.get(w) == count
            for debtor, count in acc.lent_blocks.items():
                assert self.workers[debtor].accounting().borrowed_blocks.get(w) == count

    def assert_empty(self, alive=WORKERS) -> None:
        for w in alive:
            acc = self.workers[w].accounting()
            assert (acc.local_blocks, acc.lent_blocks, acc.borrowed_blocks) == (0, {}, {})
            assert self.workers[w].local.pool.usage().free_pages == LAYOUT.num_pages


def random_context(tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, tokens, KV_DIM, generator=generator)
    values = torch.randn(LAYERS, tokens, KV_DIM, generator=generator)
    queries = torch.randn(LAYERS, tokens, HEADS, HEAD_DIM, generator=generator)
    return keys, values, queries


def write_context(rm: RManager, table: BlockTable, keys, values, start: int = 0) -> None:
    positions = torch.arange(start, keys.shape[1])
    for layer in range(LAYERS):
        rm.write(table, layer, positions, keys[layer, start:], values[layer, start:])


def assert_exact_attention(rm: RManager, table: BlockTable, keys, values, queries, positions) -> None:
    tokens = keys.shape[1]
    for layer in range(LAYERS):
        (out,) = rm.attend(layer, [TableQueries(table, queries[layer, positions], positions)])
        expected = micro_attention(
            queries[layer, positions], keys[layer].view(tokens, KV_HEADS, HEAD_DIM),
            values[layer].view(tokens, KV_HEADS, HEAD_DIM), positions, torch.arange(tokens),
        )  # fmt: skip
        assert torch.allclose(out, expected.output, atol=1e-5)


def spread_request(mesh: Mesh, tokens: int, local: int, grants: dict[str, int]) -> BlockTable:
    """A request on w0 whose prompt is placed as admission places it: its first ``local`` blocks
    in the pool, the tail borrowed from ``grants`` in order (blocks it does not need given back)."""
    rm = mesh.workers["w0"]
    table = rm.new_table()
    table.append(rm.local.allocate(local))
    for creditor, count in grants.items():
        borrowed = rm.borrow(creditor, count)
        needed = table.blocks_needed(tokens)
        table.append(borrowed[:needed])
        rm.free(borrowed[needed:])
    return table


def test_a_request_spread_over_three_workers_attends_exactly_and_releases_everything():
    mesh = Mesh()
    rm = mesh.workers["w0"]
    keys, values, queries = random_context(31, seed=0)
    # 30 prompt tokens = 8 blocks: 3 local, 3 on w1, 2 of the 3 granted by w2 (one surplus, given back).
    table = spread_request(mesh, 30, local=3, grants={"w1": 3, "w2": 3})
    assert [type(b) for b in table] == [LocalBlock] * 3 + [RemoteBlock] * 5
    assert rm.accounting().borrowed_blocks == {"w1": 3, "w2": 2}
    mesh.assert_balanced()
    write_context(rm, table, keys[:, :30], values[:, :30])
    assert_exact_attention(rm, table, keys[:, :30], values[:, :30], queries, torch.arange(30))  # prefill
    # Decode token 30 goes to the last block (on w2, two slots left); the next block would be new.
    write_context(rm, table, keys, values, start=30)
    assert_exact_attention(rm, table, keys, values, queries, torch.tensor([30]))
    rm.release(table)
    assert len(table) == 0
    mesh.assert_empty()


def test_a_request_crosses_to_remote_blocks_while_decoding():
    mesh = Mesh()
    rm = mesh.workers["w0"]
    keys, values, queries = random_context(LAYOUT.num_pages // LAYERS * BLOCK + 6, seed=1)
    table = rm.new_table()
    tokens = keys.shape[1]
    for position in range(tokens):
        if table.blocks_needed(position + 1):
            try:
                rm.reserve_local(table, position + 1)
            except PoolExhausted:
                table.append(rm.borrow("w1", 1))
        write_context(rm, table, keys[:, : position + 1], values[:, : position + 1], start=position)
    assert isinstance(table[-1], RemoteBlock) and rm.accounting().borrowed_blocks == {"w1": 2}
    assert_exact_attention(rm, table, keys, values, queries, torch.tensor([tokens - 1]))
    # Several requests of one debtor attend in one call per holder.
    other = rm.new_table()
    other.append(rm.borrow("w2", 1))
    rm.write(other, 0, torch.arange(3), keys[0, :3], values[0, :3])
    outs = rm.attend(0, [TableQueries(table, queries[0, -1:], torch.tensor([tokens - 1])),
                         TableQueries(other, queries[0, :3], torch.arange(3))])  # fmt: skip
    expected = micro_attention(queries[0, :3], keys[0, :3].view(3, KV_HEADS, HEAD_DIM),
                               values[0, :3].view(3, KV_HEADS, HEAD_DIM), torch.arange(3), torch.arange(3))  # fmt: skip
    assert torch.allclose(outs[1], expected.output, atol=1e-5)
    rm.release(table)
    rm.release(other)
    mesh.assert_empty()


def test_a_worker_lends_and_borrows_at_once():
    mesh = Mesh()
    w0, w1 = mesh.workers["w0"], mesh.workers["w1"]
    tables = {}
    for name, rm, creditor in (("w0", w0, "w1"), ("w1", w1, "w0")):
        keys, values, queries = random_context(12, seed=len(name) + ord(name[-1]))
        table = rm.new_table()
        rm.reserve_local(table, 4)
        table.append(rm.borrow(creditor, 2))
        write_context(rm, table, keys, values)
        assert_exact_attention(rm, table, keys, values, queries, torch.arange(12))
        tables[name] = table
    assert w0.accounting().lent_blocks == {"w1": 2} and w0.accounting().borrowed_blocks == {"w1": 2}
    mesh.assert_balanced()
    w0.release(tables["w0"])
    w1.release(tables["w1"])
    mesh.assert_empty()


def test_moving_blocks_between_holders_keeps_their_kv_and_the_attention():
    """DGFM's recall and swap primitive: blocks move home, out and between creditors; their KV is
    copied bit for bit, attention is unchanged, and the old blocks are freed."""
    mesh = Mesh()
    rm = mesh.workers["w0"]
    keys, values, queries = random_context(28, seed=3)
    table = spread_request(mesh, 28, local=3, grants={"w1": 2, "w2": 2})
    write_context(rm, table, keys, values)

    def stored(index: int):
        block = table[index]
        if isinstance(block, LocalBlock):
            return rm.local.read([block])
        return mesh.workers[block.creditor].lender.read("w0", [block.block_id])

    def holder(block):
        return None if isinstance(block, LocalBlock) else block.creditor

    before = [stored(i) for i in range(len(table))]
    assert rm.move(table, [3, 4], to=None) == 2  # recall from w1: local now
    assert rm.move(table, [0, 5], to="w1") == 2  # a local block out, w2's block to w1
    assert rm.move(table, [0], to="w1") == 0  # already there
    assert [holder(b) for b in table] == ["w1", None, None, None, None, "w1", "w2"]
    for index, (k, v) in enumerate(before):
        after_k, after_v = stored(index)
        assert torch.equal(after_k, k) and torch.equal(after_v, v)
    assert rm.accounting().borrowed_blocks == {"w1": 2, "w2": 1}
    mesh.assert_balanced()
    assert_exact_attention(rm, table, keys, values, queries, torch.arange(28))
    rm.release(table)
    mesh.assert_empty()


def test_a_refused_or_failed_move_leaves_the_table_as_it_was(monkeypatch):
    mesh = Mesh(cap=3)
    rm = mesh.workers["w0"]
    table = spread_request(mesh, 20, local=2, grants={"w1": 3})
    entries = list(table)
    with pytest.raises(ResourceExhausted, match="cap of 3"):
        rm.move(table, [0, 1], to="w1")
    # The destination lends, then a copy fails: the blocks it lent are given back.
    with monkeypatch.context() as patch:
        patch.setattr(mesh.workers["w2"].lender, "write", _unreachable)
        with pytest.raises(Unavailable):
            rm.move(table, [0, 2], to="w2")
    assert mesh.workers["w2"].accounting().lent_blocks == {}
    mesh.transports["w2"].kill()
    with pytest.raises(Unavailable):
        rm.move(table, [2], to="w2")
    assert list(table) == entries
    mesh.assert_balanced(alive=("w0", "w1"))
    rm.creditor_died("w1", [table])
    with pytest.raises(FailedPrecondition, match="lost"):
        rm.move(table, [2], to=None)
    rm.release(table)
    mesh.assert_empty(alive=("w0",))


def _unreachable(*args, **kwargs):
    raise Unavailable("connection reset")


def test_a_refused_borrow_borrows_nothing():
    mesh = Mesh(cap=2)
    rm = mesh.workers["w0"]
    with pytest.raises(ResourceExhausted, match="cap of 2"):
        rm.borrow("w1", 3)
    assert rm.accounting().borrowed_blocks == {}
    mesh.assert_balanced()


def test_a_dead_creditors_blocks_are_lost_and_recomputed_locally():
    mesh = Mesh()
    rm = mesh.workers["w0"]
    keys, values, queries = random_context(24, seed=2)
    table = spread_request(mesh, 24, local=2, grants={"w1": 2, "w2": 2})
    write_context(rm, table, keys, values)
    mesh.transports["w1"].kill()
    with pytest.raises(Unavailable):
        rm.attend(0, [TableQueries(table, queries[0, -1:], torch.tensor([23]))])
    lost = rm.creditor_died("w1", [table, BlockTable(BLOCK)])
    assert lost == {0: [2, 3]} and table.lost_indices() == [2, 3] and table.first_lost_position() == 8
    assert rm.accounting().borrowed_blocks == {"w2": 2}
    with pytest.raises(FailedPrecondition, match="lost with creditor w1"):
        rm.attend(0, [TableQueries(table, queries[0, -1:], torch.tensor([23]))])
    # The request rebuilds the lost blocks here and recomputes their tokens' KV (here: rewrites it).
    for index, block in zip(table.lost_indices(), rm.local.allocate(2)):
        table.replace(index, block)
    write_context(rm, table, keys[:, :16], values[:, :16], start=8)
    assert_exact_attention(rm, table, keys, values, queries, torch.arange(24))
    rm.release(table)
    mesh.assert_empty(alive=("w0", "w2"))


def test_a_creditor_reclaims_every_block_of_a_dead_debtor():
    mesh = Mesh()
    w1 = mesh.workers["w1"]
    spread_request(mesh, 28, local=3, grants={"w1": 2, "w2": 2})  # w0 then dies
    # w2 also borrows from w1: only w0's blocks are reclaimed.
    theirs = mesh.workers["w2"].new_table()
    theirs.append(mesh.workers["w2"].borrow("w1", 1))
    assert w1.debtor_died("w0") == 2
    assert w1.accounting().lent_blocks == {"w2": 1} and w1.accounting().local_blocks == 0
    assert w1.local.pool.usage().kv_pages == LAYERS
    assert mesh.workers["w2"].debtor_died("w0") == 2
    mesh.assert_balanced(alive=("w1", "w2"))
    mesh.workers["w2"].release(theirs)
    mesh.assert_empty(alive=("w1", "w2"))


def test_stale_and_foreign_blocks_are_refused_on_the_debtor_side_too():
    mesh = Mesh()
    rm = mesh.workers["w0"]
    blocks = rm.borrow("w1", 2)
    rm.free(blocks[:1])
    with pytest.raises(FailedPrecondition, match="not held"):
        rm.free(blocks[:1])
    table = rm.new_table()
    table.append(blocks[:1])
    with pytest.raises(FailedPrecondition, match="not held"):
        rm.write(table, 0, torch.tensor([0]), torch.zeros(1, KV_DIM), torch.zeros(1, KV_DIM))
    assert rm.accounting().borrowed_blocks == {"w1": 1}
    rm.free(blocks[1:])
    mesh.assert_empty()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    tokens=st.integers(1, 6 * BLOCK),
    holders=st.lists(st.sampled_from(WORKERS), min_size=6, max_size=6),
    decode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_placement_over_three_workers_attends_exactly(tokens, holders, decode, seed):
    mesh = Mesh()
    rm = mesh.workers["w0"]
    table = rm.new_table()
    for holder in holders[: table.blocks_needed(tokens)]:
        table.append(rm.local.allocate(1) if holder == "w0" else rm.borrow(holder, 1))
    keys, values, queries = random_context(tokens, seed)
    write_context(rm, table, keys, values)
    positions = torch.tensor([tokens - 1]) if decode else torch.arange(tokens)
    assert_exact_attention(rm, table, keys, values, queries, positions)
    mesh.assert_balanced()
    rm.release(table)
    mesh.assert_empty()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["request", "release", "dies"]),
        st.sampled_from(WORKERS),
        st.integers(0, 3),  # local blocks
        st.integers(0, 3),  # borrowed blocks
        st.integers(0, 10),  # which creditor / request
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_accounting_stays_exact_under_any_sequence(ops):
    """No leak, no double free: after every operation the pages and the lend/borrow ledgers of
    every worker agree, also when a worker dies (its creditors reclaim its blocks, its debtors
    mark theirs lost); at the end releasing every request leaves every pool empty."""
    mesh = Mesh(cap=5)
    tables: list[tuple[str, BlockTable]] = []
    for op, worker, local, borrowed, pick in ops:
        rm = mesh.workers[worker]
        if op == "request":
            table = rm.new_table()
            try:
                rm.reserve_local(table, local * BLOCK)
            except PoolExhausted:
                pass
            creditor = [w for w in WORKERS if w != worker][pick % 2]
            if borrowed:
                try:
                    table.append(rm.borrow(creditor, borrowed))
                except ResourceExhausted:
                    pass
            tables.append((worker, table))
        elif op == "release" and tables:
            owner, table = tables.pop(pick % len(tables))
            mesh.workers[owner].release(table)
        elif op == "dies":
            # Its creditors reclaim what it borrowed, its debtors lose what it lent, its own
            # requests die with it, and it restarts with an empty pool.
            for other in WORKERS:
                if other != worker:
                    mesh.workers[other].debtor_died(worker)
                    mesh.workers[other].creditor_died(worker, [t for o, t in tables if o == other])
            tables = [(o, t) for o, t in tables if o != worker]
            mesh.restart(worker)
        mesh.assert_balanced()
    for owner, table in tables:
        mesh.workers[owner].release(table)
    mesh.assert_empty()


def test_a_creditor_declared_dead_that_lives_gets_its_blocks_back():
    """A partition healed: the debtor recomputed, the creditor must not keep the loan forever."""
    mesh = Mesh()
    rm = mesh.workers["w0"]
    table = spread_request(mesh, 24, local=2, grants={"w1": 2, "w2": 2})
    rm.creditor_died("w1", [table])
    assert mesh.workers["w1"].accounting().lent_blocks == {}
    rm.release(table)
    mesh.assert_empty()


def test_a_creditor_restarted_under_its_id_releases_what_it_lent_and_refuses_what_it_never_did():
    """A container restarted in place keeps its pod's name: the debtor's transport reaches the new
    process, which lends afresh. A block of the old one names nothing there (``NotLent``,
    never another loan); the debtor then declares the creditor lost and every block it held there
    is released, so the new process lends nothing to nobody."""
    mesh = Mesh()
    rm = mesh.workers["w0"]
    keys, values, queries = random_context(24, seed=3)
    old = spread_request(mesh, 24, local=2, grants={"w1": 2, "w2": 2})
    write_context(rm, old, keys, values)
    lender = mesh.workers["w1"].lender
    reborn = RManager("w1", UnifiedPool(PoolView.zeros(LAYOUT, torch.float32)), lender.config)
    mesh.workers["w1"] = reborn
    mesh.transports["w1"].lender = reborn.lender  # same id, same address: the same transport
    fresh = rm.new_table()
    fresh.append(rm.borrow("w1", 3))
    assert reborn.accounting().lent_blocks == {"w0": 3}
    assert not {b.block_id for b in fresh} & {b.block_id for b in old if isinstance(b, RemoteBlock)}
    with pytest.raises(Unavailable, match="never lent by this worker process"):
        rm.attend(0, [TableQueries(old, queries[0, -1:], torch.tensor([23]))])
    rm.creditor_died("w1", [old, fresh])
    assert reborn.accounting().lent_blocks == {}
    rm.release(old)
    rm.release(fresh)
    mesh.assert_empty(alive=("w0", "w2"))


def test_loans_taken_back_from_a_debtor_that_lives_are_lost_to_it_not_an_error():
    """A partition kept the debtor from etcd until its lease expired: the creditor took its loans
    back (``debtor_died``). The debtor lives on, and its next call there must tell it that its KV
    there is gone, as a lost creditor does, not fail its step."""
    mesh = Mesh()
    rm = mesh.workers["w0"]
    keys, values, queries = random_context(24, seed=4)
    table = spread_request(mesh, 24, local=2, grants={"w1": 2, "w2": 2})
    write_context(rm, table, keys, values)
    assert mesh.workers["w1"].debtor_died("w0") == 2
    with pytest.raises(Unavailable, match="no longer lent to w0"):
        rm.attend(0, [TableQueries(table, queries[0, -1:], torch.tensor([23]))])
    assert rm.creditor_died("w1", [table]) == {0: [2, 3]}
    rm.release(table)
    mesh.assert_empty()


def test_a_creditor_refusing_a_free_is_returned_as_lost_and_the_others_are_freed(monkeypatch):
    mesh = Mesh()
    rm = mesh.workers["w0"]
    table = spread_request(mesh, 24, local=2, grants={"w1": 2, "w2": 2})

    def refuse(debtor, block_ids):
        raise PermissionDenied(f"blocks {list(block_ids)} are not lent to {debtor}")

    monkeypatch.setattr(mesh.workers["w1"].lender, "free", refuse)
    assert rm.release(table) == ["w1"]
    assert mesh.workers["w2"].accounting().lent_blocks == {} and rm.local.allocated_blocks == 0
