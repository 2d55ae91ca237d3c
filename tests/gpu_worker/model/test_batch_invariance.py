"""Batch-invariant numerics (deterministic serving), op by op: a row computed alone has the same
bits as the same row at any place in a batch of any size, in fp32 and bf16; a query's attention
has the same bits prefilled or decoded, alone or batched, local or split into block partials
computed in another pool and combined in block order; and the tiny model, forced to compute in
bf16 as a CPU with bf16 units would, gives a request the same logits alone and batched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker.attention.chunked_attention import (
    LocalQueries,
    attend_blocks,
    attend_locally,
    combine_in_block_order,
)
from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.cpu_invariant import invariant_available, invariant_error
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model import invariant_rowwise
from services.gpu_worker.model.invariant_matmul import InvariantMatmul
from services.gpu_worker.model.llama import LlamaModel

pytestmark = pytest.mark.skipif(not invariant_available(), reason=f"no native kernels: {invariant_error()}")

DTYPES = [torch.float32, torch.bfloat16]
BATCH_SIZES = (1, 2, 3, 4, 5, 8, 13, 33, 70)
"""Row counts across every tile edge of the kernels (4-row tiles, 4-row items)."""


def placements(size: int) -> list[int]:
    return sorted({0, size // 2, size - 1})


def assert_rows_invariant(op, rows: torch.Tensor, seed: int = 0) -> None:
    """``op`` (rows -> rows) gives each probed row the same bits alone and at every placement
    in batches of every size, its neighbours random."""
    g = torch.Generator().manual_seed(seed)
    others = torch.randn(max(BATCH_SIZES), *rows.shape[1:], generator=g).to(rows.dtype)
    for probe in range(rows.shape[0]):
        alone = op(rows[probe : probe + 1])[0]
        for size in BATCH_SIZES:
            for place in placements(size):
                batch = others[:size].clone()
                batch[place] = rows[probe]
                assert torch.equal(op(batch)[place], alone), f"row {probe} at {place} of {size}"


@pytest.mark.parametrize("compute", DTYPES)
@pytest.mark.parametrize("storage", DTYPES)
@pytest.mark.parametrize("in_f,out_f,bias", [(72, 100, False), (61, 50, True), (576, 130, False)])
def test_matmul_rows_do_not_depend_on_the_batch(storage, compute, in_f, out_f, bias):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(out_f, in_f, generator=g).to(storage)
    b = torch.randn(out_f, generator=g).to(storage) if bias else None
    matmul = InvariantMatmul(compute)
    x = torch.randn(3, in_f, generator=g).to(compute)
    assert_rows_invariant(lambda rows: matmul.linear(rows, weight, b), x)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    tolerance = 1e-4 if compute == torch.float32 else 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(matmul.linear(x, weight, b).double(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 61])
def test_rms_norm_and_swiglu_rows_do_not_depend_on_the_batch(dtype, width):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(width, generator=g).to(dtype)
    x = (3 * torch.randn(3, width, generator=g)).to(dtype)
    assert_rows_invariant(lambda rows: invariant_rowwise.rms_norm(rows, weight, 1e-5, dtype), x)
    assert_rows_invariant(lambda rows: invariant_rowwise.swiglu(rows, rows.flip(-1)), x)
    # Close to the torch formulas (HF's).
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * weight
    torch.testing.assert_close(invariant_rowwise.rms_norm(x, weight, 1e-5, dtype), expected)
    torch.testing.assert_close(invariant_rowwise.swiglu(x, x.flip(-1)), F.silu(x) * x.flip(-1))


# -- attention ------------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


class Context:
    """One request's KV (L tokens) scattered over pool pages in random order, and its queries."""

    def __init__(self, pool: UnifiedPool, length: int, pages: list[int], generator: torch.Generator):
        self.length = length
        self.pages = pages
        kv_dim = KV_HEADS * HEAD_DIM
        blocks = pool.buffer.view(-1, BLOCK * kv_dim)
        for index, page in enumerate(pages):
            for block in (2 * page, 2 * page + 1):
                blocks[block] = torch.randn(BLOCK * kv_dim, generator=generator).to(pool.buffer.dtype)
        self.queries = torch.randn(length, HEADS, HEAD_DIM, generator=generator)

    def table(self) -> torch.Tensor:
        return 2 * torch.tensor(self.pages, dtype=torch.int64)

    def keys_values(self, pool: UnifiedPool) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = pool.buffer.view(-1, BLOCK * KV_HEADS * HEAD_DIM).float()
        shape = (-1, KV_HEADS, HEAD_DIM)
        return blocks[self.table()].view(shape)[: self.length], blocks[self.table() + 1].view(shape)[
            : self.length
        ]


def attend(pool, contexts_and_rows: list[tuple[Context, list[int]]], dtype) -> list[torch.Tensor]:
    """One local attention call for the queries at the given positions of each context, all in
    one step's rows (contexts side by side in one padded table); the output rows of each."""
    queries, positions, table_of_row, spans = [], [], [], []
    width = max(len(c.pages) for c, _ in contexts_and_rows)
    tables = torch.zeros(len(contexts_and_rows), width, dtype=torch.int64)
    for index, (context, rows) in enumerate(contexts_and_rows):
        tables[index, : len(context.pages)] = context.table()
        spans.append((len(queries), len(queries) + len(rows)))
        queries += [context.queries[r] for r in rows]
        positions += rows
        table_of_row += [index] * len(rows)
    q = torch.stack(queries).to(dtype)
    group = LocalQueries(torch.arange(len(queries)), torch.tensor(table_of_row), tables.unsqueeze(0))
    out = attend_locally(q, [group], torch.tensor(positions), 0, pool, KV_HEADS)
    return [out[start:end] for start, end in spans]


def make_pool(dtype) -> UnifiedPool:
    layout = PoolLayout(num_pages=64, kv_block_tokens=BLOCK, kv_dim=KV_HEADS * HEAD_DIM, num_layers=1)
    return UnifiedPool(PoolView.zeros(layout, dtype))


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("pool_dtype", DTYPES)
def test_attention_is_the_same_prefilled_decoded_batched_and_split(pool_dtype, q_dtype):
    g = torch.Generator().manual_seed(3)
    pool = make_pool(pool_dtype)
    pages = torch.randperm(64, generator=g).tolist()
    target = Context(pool, 37, pages[:10], g)  # 10 blocks, the last one partly filled
    others = [
        Context(pool, n, pages[10 + 12 * i : 10 + 12 * i + -(-n // BLOCK)], g)
        for i, n in enumerate((5, 44, 17))
    ]
    (prefilled,) = attend(pool, [(target, list(range(37)))], q_dtype)
    # Against SDPA over the whole context.
    keys, values = target.keys_values(pool)
    reference = F.scaled_dot_product_attention(
        target.queries.to(q_dtype).float().transpose(0, 1)[None], keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None], is_causal=True, enable_gqa=True,
    )[0].transpose(0, 1).reshape(37, -1)  # fmt: skip
    tolerance = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(prefilled.float(), reference, atol=tolerance, rtol=0)
    for position in (0, 3, 4, 17, 36):
        expected = prefilled[position]
        # Decoded alone, decoded among other requests (before and after it), prefilled in part.
        (alone,) = attend(pool, [(target, [position])], q_dtype)
        batched = attend(pool, [(others[0], [4]), (target, [position]), (others[1], [43, 12])], q_dtype)
        chunk = attend(pool, [(others[2], list(range(17))), (target, list(range(position, 37)))], q_dtype)
        assert torch.equal(alone[0], expected)
        assert torch.equal(batched[1][0], expected)
        assert torch.equal(chunk[1][0], expected)


@pytest.mark.parametrize("pool_dtype", DTYPES)
def test_block_partials_from_another_pool_combine_to_the_local_bits(pool_dtype):
    """What a debtor gets for a request whose blocks are spread over holders (each block's
    partial where it lives, combined in block order) equals its local attention bit for bit."""
    g = torch.Generator().manual_seed(4)
    pool, lender = make_pool(pool_dtype), make_pool(pool_dtype)
    target = Context(pool, 30, torch.randperm(64, generator=g)[:8].tolist(), g)
    rows = list(range(30))
    (local,) = attend(pool, [(target, rows)], torch.float32)
    # Half of the blocks live in the lender's pool, on other pages.
    lent_pages = torch.randperm(64, generator=g)[:8].tolist()
    source, dest = (
        pool.buffer.view(-1, BLOCK * KV_HEADS * HEAD_DIM),
        lender.buffer.view(-1, BLOCK * KV_HEADS * HEAD_DIM),
    )
    for index in range(0, 8, 2):
        dest[2 * lent_pages[index] : 2 * lent_pages[index] + 2] = source[
            2 * target.pages[index] : 2 * target.pages[index] + 2
        ]
    positions = torch.arange(30)
    partials = [
        attend_blocks(lender if index % 2 == 0 else pool, [lent_pages[index] if index % 2 == 0 else page],
                      [index * BLOCK], target.queries, positions)
        for index, page in enumerate(target.pages)
    ]  # fmt: skip
    combined = combine_in_block_order(partials).output.reshape(30, -1)
    assert torch.equal(combined, local)
    # One call over all blocks (what a non-deterministic debtor asks of a holder): the same bits too.
    whole = attend_blocks(pool, target.pages, [i * BLOCK for i in range(8)], target.queries, positions)
    assert torch.equal(whole.output.reshape(30, -1), local)
    assert torch.isfinite(whole.lse).all()


# -- the model, in bf16 compute ----------------------------------------------------------------


def logits_of(
    engine: Engine, requests: list[GenerationRequest], stagger: int = 0
) -> dict[str, list[torch.Tensor]]:
    logits: dict[str, list[torch.Tensor]] = {}
    engine.on_logits = lambda rid, row: logits.setdefault(rid, []).append(row.clone())
    for index, request in enumerate(requests):
        engine.submit(request, lambda event: None)
        if stagger and index % stagger == stagger - 1:
            engine.step()
    while engine.has_work():
        engine.step()
    return logits


@pytest.mark.parametrize("compute", DTYPES)
def test_the_tiny_model_gives_a_request_the_same_logits_alone_and_batched(tiny_llama, compute):
    """bf16 compute is what a CPU with bf16 units (or a GPU) runs; forced here on AVX2."""
    model = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.bfloat16, compute_dtype=compute)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [
        tuple(torch.randint(1, 250, (int(n),), generator=g).tolist()) for n in (5, 19, 2, 33, 11, 8, 26)
    ]
    requests = [GenerationRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]

    def engine() -> Engine:
        return local_engine(model, EngineConfig(pool_mib=4, kv_block_tokens=BLOCK, deterministic=True))

    batched = logits_of(engine(), requests, stagger=2)
    for request in requests[:3]:
        alone = logits_of(engine(), [request])[request.request_id]
        assert all(torch.equal(a, b) for a, b in zip(alone, batched[request.request_id], strict=True))
