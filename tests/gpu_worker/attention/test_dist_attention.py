"""DistAttention: micro-attentions over any split of a request's KV blocks, scale-reduced, equal
single-place attention and the engine's own paged attention (fp32, 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gpu_worker.attention import dist_attention
from services.gpu_worker.attention.dist_attention import (
    PartialAttention,
    empty_partial,
    micro_attention,
    scale_reduce,
)
from services.gpu_worker.attention.pool_block_attention import attend_pool_blocks
from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.engine.request import EngineRequest, GenerationRequest
from services.gpu_worker.engine.step_plan import StepPlan
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.memory.kv_cache import KvTable
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.step_ops import TorchStepOps
from services.model_files.model_config import ModelConfig

# SmolLM2-135M's attention shape.
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
ATOL = 1e-5


def reference_attention(q, k, v, q_pos, k_pos) -> torch.Tensor:
    """Single-place causal attention with SDPA: [n, heads, head_dim]."""
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def random_kv(context: int, generator: torch.Generator):
    k = torch.randn(context, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(context, KV_HEADS, HEAD_DIM, generator=generator)
    return k, v


def split_attention(q, k, v, q_pos, block: int, owners: list[int], workers: int) -> PartialAttention:
    """Each of ``workers`` attends over the blocks ``owners`` assigns it; the partials are reduced."""
    partials = []
    for worker in range(workers):
        mine = [b for b, owner in enumerate(owners) if owner == worker]
        rows = torch.tensor([b * block + s for b in mine for s in range(block)], dtype=torch.int64)
        rows = rows[rows < k.shape[0]]
        partials.append(micro_attention(q, k[rows], v[rows], q_pos, rows))
    return scale_reduce(partials)


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("decode", [False, True])
def test_split_over_workers_equals_single_place_attention(workers: int, decode: bool):
    generator = torch.Generator().manual_seed(workers + 10 * decode)
    context, block = 77, 8
    k, v = random_kv(context, generator)
    q_pos = torch.tensor([context - 1]) if decode else torch.arange(context)
    q = torch.randn(q_pos.numel(), HEADS, HEAD_DIM, generator=generator)
    num_blocks = -(-context // block)
    owners = torch.randint(0, workers, (num_blocks,), generator=generator).tolist()
    combined = split_attention(q, k, v, q_pos, block, owners, workers)
    expected = reference_attention(q, k, v, q_pos, torch.arange(context))
    assert combined.output.dtype == torch.float32
    assert torch.allclose(combined.output, expected, atol=ATOL)
    # The combined log-sum-exp is that of the whole context.
    scores = torch.einsum("nhd,mhd->nhm", q, k.repeat_interleave(HEADS // KV_HEADS, dim=1)) / math.sqrt(
        HEAD_DIM
    )
    scores = scores.masked_fill(~(torch.arange(context)[None, None, :] <= q_pos[:, None, None]), -math.inf)
    assert torch.allclose(combined.lse, torch.logsumexp(scores, dim=-1), atol=ATOL)


def test_gqa_maps_query_head_to_its_kv_group():
    generator = torch.Generator().manual_seed(1)
    k, v = random_kv(5, generator)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=generator)
    pos = torch.arange(5)
    out = micro_attention(q, k, v, torch.tensor([4]), pos).output
    for head in range(HEADS):
        kv_head = head // (HEADS // KV_HEADS)
        one = reference_attention(q[:, head : head + 1], k[:, kv_head : kv_head + 1], v[:, kv_head : kv_head + 1],
                                  torch.tensor([4]), pos)  # fmt: skip
        assert torch.allclose(out[:, head], one[:, 0], atol=ATOL)


def test_a_block_entirely_in_the_future_contributes_nothing_and_no_nan():
    generator = torch.Generator().manual_seed(2)
    k, v = random_kv(32, generator)
    q_pos = torch.arange(10)  # prefill of the first 10 tokens; keys 16..31 are all in the future
    q = torch.randn(10, HEADS, HEAD_DIM, generator=generator)
    future = micro_attention(q, k[16:], v[16:], q_pos, torch.arange(16, 32))
    assert not future.output.isnan().any() and not future.lse.isnan().any()
    assert torch.equal(future.output, torch.zeros_like(future.output))
    assert torch.isneginf(future.lse).all()
    # Partly visible: query 3 sees only keys 0..3 of the first block, query 0 only key 0.
    past = micro_attention(q, k[:16], v[:16], q_pos, torch.arange(16))
    combined = scale_reduce([future, past])
    assert torch.allclose(
        combined.output, reference_attention(q, k[:10], v[:10], q_pos, torch.arange(10)), atol=ATOL
    )
    assert torch.equal(combined.output, scale_reduce([past, future]).output)


def test_empty_block_sets():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(4, HEADS, HEAD_DIM, generator=generator)
    none = micro_attention(q, torch.empty(0, KV_HEADS, HEAD_DIM), torch.empty(0, KV_HEADS, HEAD_DIM),
                           torch.arange(4), torch.empty(0, dtype=torch.int64))  # fmt: skip
    assert none.output.shape == (4, HEADS, HEAD_DIM) and none.lse.shape == (4, HEADS)
    assert torch.equal(none.output, empty_partial(4, HEADS, HEAD_DIM).output)
    assert torch.isneginf(none.lse).all()
    # Reducing nothing but empties stays empty, without NaN.
    both = scale_reduce([none, empty_partial(4, HEADS, HEAD_DIM)])
    assert not both.output.isnan().any() and torch.isneginf(both.lse).all()
    # An empty partial is the identity of the reduce.
    k, v = random_kv(6, generator)
    some = micro_attention(q, k, v, torch.arange(4) + 2, torch.arange(6))
    assert torch.equal(scale_reduce([some, none]).output, some.output)
    with pytest.raises(ValueError):
        scale_reduce([])


def test_long_prefills_attend_in_query_chunks_exactly(monkeypatch):
    generator = torch.Generator().manual_seed(6)
    k, v = random_kv(40, generator)
    q, q_pos = torch.randn(40, HEADS, HEAD_DIM, generator=generator), torch.arange(40)
    whole = micro_attention(q, k, v, q_pos, q_pos)
    monkeypatch.setattr(dist_attention, "_SCORE_ELEMENTS", 3 * HEADS * 40)  # chunks of 3 queries
    chunked = micro_attention(q, k, v, q_pos, q_pos)
    assert torch.allclose(chunked.output, whole.output, atol=1e-6)
    assert torch.allclose(chunked.lse, whole.lse, atol=1e-6)
    assert torch.allclose(chunked.output, reference_attention(q, k, v, q_pos, q_pos), atol=ATOL)


def test_reduce_is_closed_under_grouping():
    """A creditor may pre-reduce the blocks it holds: ((a, b), c) == (a, (b, c)) == (a, b, c)."""
    generator = torch.Generator().manual_seed(4)
    k, v = random_kv(48, generator)
    q, q_pos = torch.randn(2, HEADS, HEAD_DIM, generator=generator), torch.tensor([30, 47])
    a, b, c = (
        micro_attention(q, k[s : s + 16], v[s : s + 16], q_pos, torch.arange(s, s + 16)) for s in (0, 16, 32)
    )
    flat = scale_reduce([a, b, c])
    for grouped in (scale_reduce([scale_reduce([a, b]), c]), scale_reduce([a, scale_reduce([b, c])])):
        assert torch.allclose(grouped.output, flat.output, atol=ATOL)
        assert torch.allclose(grouped.lse, flat.lse, atol=ATOL)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    context=st.integers(1, 70),
    block=st.sampled_from([1, 4, 16]),
    workers=st.integers(1, 4),
    decode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_split_equals_single_place_attention(
    context: int, block: int, workers: int, decode: bool, seed: int
):
    generator = torch.Generator().manual_seed(seed)
    k, v = random_kv(context, generator)
    q_pos = torch.tensor([context - 1]) if decode else torch.arange(context)
    q = torch.randn(q_pos.numel(), HEADS, HEAD_DIM, generator=generator)
    owners = torch.randint(0, workers, (-(-context // block),), generator=generator).tolist()
    combined = split_attention(q, k, v, q_pos, block, owners, workers)
    assert torch.allclose(
        combined.output, reference_attention(q, k, v, q_pos, torch.arange(context)), atol=ATOL
    )


# -- against the engine's paged attention (llama.py) ------------------------------------------


def smollm2_shaped_model() -> LlamaModel:
    """One decoder layer with SmolLM2's attention shape (9 q heads, 3 kv heads, head dim 64)."""
    hidden, inter, vocab = HEADS * HEAD_DIM, 32, 16
    config = ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=1,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=None, eos_token_ids=(), name="smollm2-shaped",
    )  # fmt: skip
    kv = KV_HEADS * HEAD_DIM
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
        "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
        "model.layers.0.self_attn.k_proj.weight": (kv, hidden),
        "model.layers.0.self_attn.v_proj.weight": (kv, hidden),
        "model.layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "model.layers.0.mlp.gate_proj.weight": (inter, hidden), "model.layers.0.mlp.up_proj.weight": (inter, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, inter),
        "model.layers.0.input_layernorm.weight": (hidden,), "model.layers.0.post_attention_layernorm.weight": (hidden,),
    }  # fmt: skip
    return LlamaModel(config, {name: torch.zeros(shape) for name, shape in shapes.items()}, torch.float32)


def test_split_pool_blocks_match_the_engines_paged_attention():
    """Requests prefilling and decoding together: the engine's attention (``TorchStepOps.attention``, SDPA
    over the step builder's block tables) equals micro-attentions over random subsets of each
    request's pool pages (``attend_pool_blocks``, what a creditor runs), scale-reduced."""
    model = smollm2_shaped_model()
    block = 4
    layout = PoolLayout(num_pages=64, kv_block_tokens=block, kv_dim=KV_HEADS * HEAD_DIM, num_layers=1)
    pool = UnifiedPool(PoolView.zeros(layout, torch.float32))
    generator = torch.Generator().manual_seed(5)
    # (prompt length, output so far, computed): a prefill of 11, decodes at 9 and 14 tokens.
    shapes = [(11, 0, 0), (6, 3, 8), (10, 4, 13)]
    requests = []
    for index, (prompt, output, computed) in enumerate(shapes):
        kv = KvTable(pool)
        kv.reserve(prompt + output)
        spec = GenerationRequest(f"r{index}", tuple(range(prompt)))
        request = EngineRequest(spec=spec, kv=kv, output_ids=list(range(output)), num_computed=computed)
        requests.append(request)
        # The whole context's KV (the engine writes the new tokens' rows itself; here the test does).
        keys, values = kv.rows(torch.arange(prompt + output))
        pool.kv_rows[keys[:, 0]] = torch.randn(prompt + output, KV_HEADS * HEAD_DIM, generator=generator)
        pool.kv_rows[values[:, 0]] = torch.randn(prompt + output, KV_HEADS * HEAD_DIM, generator=generator)
    plan = StepPlan(tuple(r.planned(None) for r in requests), lora_backend="auto", batch_invariant=False)
    batch = StepBuilder(model, pool).build(plan, resident=lambda _: None)
    q = torch.randn(batch.token_ids.numel(), HEADS, HEAD_DIM, generator=generator)
    ops = TorchStepOps(model, batch, pool, model.matmul.linear, native=False, queries=None)
    engine_out = ops.attention(q, 0).view(-1, HEADS, HEAD_DIM)

    row = 0
    for request in requests:
        new = request.new_tokens
        positions = batch.positions[row : row + new]
        pages = [blocks[0] for blocks in request.kv.blocks]
        owners = torch.randint(0, 3, (len(pages),), generator=generator).tolist()
        partials = [
            attend_pool_blocks(
                pool,
                [p for p, o in zip(pages, owners) if o == worker],
                [b * block for b, o in enumerate(owners) if o == worker],
                q[row : row + new],
                positions,
            )
            for worker in range(3)
        ]
        combined = scale_reduce(partials).output
        assert torch.allclose(combined, engine_out[row : row + new], atol=ATOL), request.request_id
        row += new
    assert row == batch.token_ids.numel()
