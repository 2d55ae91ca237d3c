"""Multi-adapter LoRA kernels over the unified pool: every backend against the torch reference,
and the reference against a dense per-token computation.

Triton kernels run in the CPU interpreter: ``TRITON_INTERPRET`` is set here, before anything
imports ``triton_lora`` (nothing does at package import), because triton decides between compiled
and interpreted kernels when ``@triton.jit`` runs. Shapes are small for the interpreter's sake.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from support.kernel_backends import available_backends

from services.gpu_worker.kernels.cpu_native import lora_delta_cpu_native
from services.gpu_worker.kernels.dispatch import BACKENDS, add_lora_delta
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments, SegmentGroup
from services.gpu_worker.kernels.padded_bmm import lora_delta_padded_bmm
from services.gpu_worker.kernels.torch_reference import lora_delta_torch

Kernel = Callable[[torch.Tensor, torch.Tensor, LoraSegments, torch.Tensor], None]

ADAPTER_RANKS = (8, 64, 16, 32, 128)
"""Ranks of the test adapters: S-LoRA's heterogeneous batch, tiny next to large; 128 spans two
64-wide rank blocks."""
PREFILL_COUNTS = (5, 17, 3, 33, 2, 9, 4, 6)
PREFILL_ADAPTERS = (0, 1, None, 2, 0, 3, 3, 4)
"""Segment -> adapter index: adapter 0 twice non-adjacent, adapter 3 twice adjacent, one base-only."""
DECODE_ADAPTERS = (0, 1, None, 2, 0, 3, 1, 4, 1, None)
FEATURES = ((96, 80), (64, 256), (192, 64))
"""(in_features, out_features) pairs; 96 and 80 are not multiples of the 64-wide blocks."""


@dataclass
class Case:
    """One random batch: a NaN-filled pool with adapter rows scattered over it, x and a pre-filled out."""

    pool: torch.Tensor
    """The unified pool; everything that is not an adapter row is NaN, so a stray read shows."""
    seg: LoraSegments
    """The batch description under test."""
    x: torch.Tensor
    """Input activations [T, in]."""
    out0: torch.Tensor
    """The pre-filled output [T, out] every backend adds into (copied per run)."""
    base_rows: torch.Tensor
    """Token rows of rank-0 segments (must stay bit-identical)."""
    dense: list[tuple[torch.Tensor, torch.Tensor, float] | None]
    """Per segment: (A [r, in], B [out, r], scale) materialized from the pool, or None."""

    def run(self, kernel: Kernel, out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.out0.clone() if out is None else out
        kernel(self.x, self.pool, self.seg, out)
        return out


def make_case(
    counts: tuple[int, ...],
    adapter_ids: tuple[int | None, ...],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
    x_dtype: torch.dtype | None = None,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    slot = max(in_features, out_features) + 32  # every row fits in one slot, at a random position
    n_rows = 2 * sum(ADAPTER_RANKS)
    # Twice as many slots as rows, in random order: rows of one adapter land far apart, with gaps.
    slots = torch.randperm(2 * n_rows, generator=g)[:n_rows]
    pool = torch.full((2 * n_rows * slot,), float("nan"))
    next_slot = 0

    def place(width: int, rows: torch.Tensor) -> torch.Tensor:
        nonlocal next_slot
        r = rows.shape[0]
        jitter = torch.randint(0, slot - width + 1, (r,), generator=g)
        offsets = slots[next_slot : next_slot + r] * slot + jitter
        next_slot += r
        for j in range(r):
            pool[offsets[j] : offsets[j] + width] = rows[j]
        return offsets.long()

    adapters = []
    for r in ADAPTER_RANKS:
        a = torch.randn(r, in_features, generator=g) / in_features**0.5
        b = torch.randn(out_features, r, generator=g) / r**0.5
        a_off = place(in_features, a)
        b_off = place(out_features, b.T)
        adapters.append((AdapterRows(a_off.to(device), b_off.to(device)), 16.0 / r))
    pool = pool.to(dtype).to(device)

    rows = [adapters[i][0] if i is not None else None for i in adapter_ids]
    scales = [adapters[i][1] if i is not None else 1.0 for i in adapter_ids]
    seg = LoraSegments.build(list(counts), rows, scales, in_features, out_features, device)
    tokens = sum(counts)
    x = torch.randn(tokens, in_features, generator=g).to(x_dtype or dtype).to(device)
    out0 = torch.randn(tokens, out_features, generator=g).to(dtype).to(device)
    starts = seg.seg_starts_host
    base_rows = torch.cat(
        [torch.arange(starts[s], starts[s + 1]) for s, i in enumerate(adapter_ids) if i is None]
    ).to(device)
    return Case(pool, seg, x, out0, base_rows, _materialize(pool, rows, scales, in_features, out_features))


def _materialize(
    pool: torch.Tensor, rows: list[AdapterRows | None], scales: list[float], in_f: int, out_f: int
) -> list[tuple[torch.Tensor, torch.Tensor, float] | None]:
    """A and B rebuilt row by row from the pool, the way PEFT holds them."""
    dense: list[tuple[torch.Tensor, torch.Tensor, float] | None] = []
    for adapter, scale in zip(rows, scales, strict=True):
        if adapter is None:
            dense.append(None)
            continue
        a = torch.stack([pool[o : o + in_f] for o in adapter.a_offsets.tolist()]).float()
        b_t = torch.stack([pool[o : o + out_f] for o in adapter.b_offsets.tolist()]).float()
        dense.append((a, b_t.T, scale))
    return dense


def dense_expected(case: Case) -> torch.Tensor:
    """``out0[t] + scale * B @ (A @ x[t])``, token by token, in fp32."""
    expected = case.out0.float().clone()
    starts = case.seg.seg_starts_host
    for s, weights in enumerate(case.dense):
        if weights is None:
            continue
        a, b, scale = weights
        for t in range(starts[s], starts[s + 1]):
            expected[t] += scale * (b @ (a @ case.x[t].float()))
    return expected


def prefill(in_f: int, out_f: int, dtype: torch.dtype, **kw) -> Case:
    return make_case(PREFILL_COUNTS, PREFILL_ADAPTERS, in_f, out_f, dtype, **kw)


def decode(in_f: int, out_f: int, dtype: torch.dtype, **kw) -> Case:
    return make_case((1,) * len(DECODE_ADAPTERS), DECODE_ADAPTERS, in_f, out_f, dtype, **kw)


def assert_matches(got: torch.Tensor, case: Case, expected: torch.Tensor) -> None:
    """Close to ``expected`` (fp32: 1e-4 absolute, half: 1e-2 of the largest value), with the rows
    of rank-0 segments untouched bit for bit."""
    assert got.dtype == case.out0.dtype
    assert not got.isnan().any(), "a kernel read outside the adapter rows (the pool is NaN there)"
    atol = 1e-4 if got.dtype == torch.float32 else 1e-2 * expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)
    assert torch.equal(got[case.base_rows], case.out0[case.base_rows])


@pytest.fixture(scope="module")
def triton_lora() -> ModuleType:
    from services.gpu_worker.kernels import triton_lora

    assert triton_lora.INTERPRETED, "triton_lora was imported before TRITON_INTERPRET=1 was set"
    return triton_lora


def kernel_fn(triton_lora: ModuleType, name: str) -> Kernel:
    """A backend by name: the torch reference, padded bmm, the native CPU kernel, or a Triton wrapper."""
    cpu = {
        "torch": lora_delta_torch,
        "padded_bmm": lora_delta_padded_bmm,
        "cpu_native": lora_delta_cpu_native,
    }
    return cpu.get(name) or getattr(triton_lora, name)


@pytest.mark.parametrize("in_f,out_f", FEATURES)
@pytest.mark.parametrize("make", [prefill, decode])
def test_reference_equals_dense_per_token_math(make, in_f: int, out_f: int) -> None:
    case = make(in_f, out_f, torch.float32)
    expected = dense_expected(case)
    assert (expected - case.out0).abs().max() > 0.1, "the test adapters must change out"
    assert_matches(case.run(lora_delta_torch), case, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_f,out_f", FEATURES)
@pytest.mark.parametrize(
    "kernel,make",
    [
        ("padded_bmm", prefill),
        ("padded_bmm", decode),
        ("cpu_native", prefill),
        ("cpu_native", decode),
        ("mbgmm", prefill),
        ("mbgmm", decode),
        ("mbgmv", decode),
    ],
)
def test_backend_matches_reference(triton_lora, kernel: str, make, in_f: int, out_f: int, dtype) -> None:
    fn = kernel_fn(triton_lora, kernel)
    case = make(in_f, out_f, dtype, seed=in_f + out_f)
    assert_matches(case.run(fn), case, case.run(lora_delta_torch))


@pytest.mark.parametrize("kernel", ["torch", "padded_bmm", "cpu_native", "mbgmm", "mbgmv"])
def test_out_is_accumulated_in_place_and_x_may_be_another_dtype(triton_lora, kernel: str) -> None:
    # x in fp32 while pool/out are fp16 (the model may keep activations wider than the pool).
    case = decode(96, 80, torch.float16, x_dtype=torch.float32)
    fn = kernel_fn(triton_lora, kernel)
    out = case.out0.clone()
    ptr = out.data_ptr()
    assert case.run(fn, out) is out and out.data_ptr() == ptr
    assert_matches(out, case, dense_expected(case))
    twice = case.run(fn, out)  # a second call adds the delta again
    assert_matches(twice, case, 2 * dense_expected(case) - case.out0.float())


@pytest.mark.parametrize("kernel", ["cpu_native", "mbgmm", "mbgmv"])
def test_kernels_read_strided_views(triton_lora, kernel: str) -> None:
    # x and out as column slices of fused buffers (e.g. one qkv output): row strides != widths.
    case = decode(64, 80, torch.float32)
    wide_x = torch.randn(case.x.shape[0], 200)
    wide_x[:, 40:104] = case.x
    wide_out = torch.zeros(case.out0.shape[0], 300)
    wide_out[:, 100:180] = case.out0
    kernel_fn(triton_lora, kernel)(wide_x[:, 40:104], case.pool, case.seg, wide_out[:, 100:180])
    assert_matches(wide_out[:, 100:180], case, case.run(lora_delta_torch))
    assert not wide_out[:, :100].any() and not wide_out[:, 180:].any()


@pytest.mark.parametrize("kernel", ["torch", "padded_bmm", "cpu_native", "mbgmm", "mbgmv"])
def test_batch_without_adapters_is_a_no_op(triton_lora, kernel: str) -> None:
    case = make_case((1, 1, 1), (None, None, None), 64, 64, torch.float32)
    fn = kernel_fn(triton_lora, kernel)
    assert case.seg.max_rank == 0 and case.seg.a_offsets.numel() == 0
    assert torch.equal(case.run(fn), case.out0)


def test_mbgmv_refuses_prefill_segments(triton_lora) -> None:
    case = prefill(64, 64, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        case.run(triton_lora.mbgmv)


def test_build_describes_the_batch() -> None:
    rows = [
        AdapterRows(torch.arange(r, dtype=torch.int64) * 1000, torch.arange(r) * 1000 + 500) for r in (8, 64)
    ]
    seg = LoraSegments.build(
        [3, 0, 2, 4, 1], [rows[0], rows[1], None, rows[0], rows[0]], [2.0, 0.25, 1.0, 2.0, 2.0], 96, 80, "cpu"
    )
    assert seg.seg_starts.dtype == seg.rank_starts.dtype == torch.int32
    assert seg.seg_starts.tolist() == [0, 3, 3, 5, 9, 10] == list(seg.seg_starts_host)
    assert seg.rank_starts.tolist() == [0, 8, 72, 72, 80, 88] == list(seg.rank_starts_host)
    assert torch.equal(
        seg.a_offsets, torch.cat([rows[0].a_offsets, rows[1].a_offsets, rows[0].a_offsets, rows[0].a_offsets])
    )
    assert seg.b_offsets.dtype == torch.int64 and seg.b_offsets.shape == (88,)
    assert seg.scales.dtype == torch.float32 and seg.scales.tolist() == [2.0, 0.25, 1.0, 2.0, 2.0]
    assert (seg.max_rank, seg.max_seg_len, seg.is_decode) == (64, 4, False)
    assert (seg.num_segments, seg.num_tokens) == (5, 10)
    # Adapter 1's only segment is empty: no group; adapter 0's last two segments are adjacent.
    assert seg.groups == (
        SegmentGroup(rows=rows[0], rank_start=0, rank_end=8, scale=2.0, token_ranges=((0, 3), (5, 10))),
    )
    assert LoraSegments.build([1, 1], [None, rows[1]], [1.0, 1.0], 96, 80, "cpu").is_decode


def test_with_rows_is_build_over_another_layers_rows() -> None:
    """What the step builder does for layers 1.. of a projection: the same adapters' other rows."""

    def rows_of(base: int) -> list[AdapterRows]:
        return [
            AdapterRows(torch.arange(r, dtype=torch.int64) * 1000 + base, torch.arange(r) * 1000 + base + 500)
            for r in (8, 64, 8)
        ]

    counts, scales = [3, 1, 2, 4, 1], [2.0, 0.25, 2.0, 2.0, 0.5]
    layer0, layer1 = rows_of(0), rows_of(7)
    template = LoraSegments.build(
        counts, [layer0[0], layer0[1], None, layer0[0], layer0[2]], scales, 96, 80, "cpu"
    )
    adapters1 = [layer1[0], layer1[1], None, layer1[0], layer1[2]]
    copied, built = (
        template.with_rows(adapters1),
        LoraSegments.build(counts, adapters1, scales, 96, 80, "cpu"),
    )
    for name in ("seg_starts", "rank_starts", "a_offsets", "b_offsets", "scales"):
        assert torch.equal(getattr(copied, name), getattr(built, name)), name
    assert copied.shared is template.shared and copied.derived is not template.derived
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(0))
    pool = torch.randn(64 * 1000 + 600, generator=torch.Generator().manual_seed(1))
    outs = [torch.zeros(11, 80), torch.zeros(11, 80)]
    lora_delta_cpu_native(x, pool, template, torch.zeros(11, 80))  # fills the shared plan first
    lora_delta_cpu_native(x, pool, copied, outs[0])
    lora_delta_cpu_native(x, pool, built, outs[1])
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    assert copied._groups is None  # the native kernel never needed the copy's group objects
    assert copied.groups == built.groups and copied.group_first_segments == built.group_first_segments


def test_build_rejects_inconsistent_input() -> None:
    rows = AdapterRows(torch.arange(4, dtype=torch.int64), torch.arange(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="2 token counts, 1 adapters"):
        LoraSegments.build([1, 1], [rows], [1.0, 1.0], 8, 8, "cpu")
    with pytest.raises(ValueError, match="rank 0"):
        AdapterRows(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="4 A rows but 3 B rows"):
        AdapterRows(torch.arange(4, dtype=torch.int64), torch.arange(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        AdapterRows(torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int64))


@pytest.mark.parametrize("make", [prefill, decode])
@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_dispatch(triton_lora, make, backend: str) -> None:
    assert "triton" in available_backends()
    case = make(96, 80, torch.float32)
    assert_matches(case.run(lambda *a: add_lora_delta(*a, backend=backend)), case, case.run(lora_delta_torch))


def test_dispatch_rejects_unknown_backend() -> None:
    case = decode(64, 64, torch.float32)
    with pytest.raises(ValueError, match="unknown LoRA backend 'cuda'"):
        case.run(lambda *a: add_lora_delta(*a, backend="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_kernels_on_cuda(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    # This module set TRITON_INTERPRET=1; a private copy of the kernel module loaded without it
    # gets compiled kernels.
    monkeypatch.delenv("TRITON_INTERPRET")
    spec = importlib.util.find_spec("services.gpu_worker.kernels.triton_lora")
    compiled = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compiled)
    assert not compiled.INTERPRETED
    for make, kernels in ((prefill, ("mbgmm",)), (decode, ("mbgmm", "mbgmv"))):
        for in_f, out_f in (*FEATURES, (576, 1536)):  # the last: SmolLM2's gate/up projection
            case = make(in_f, out_f, dtype, device="cuda")
            expected = case.run(lora_delta_torch)
            # Half pools use tensor-core dots on a half-rounded h: a few half ulps of error.
            for fn in (*(getattr(compiled, k) for k in kernels), lora_delta_padded_bmm):
                got = case.run(fn)
                assert not got.isnan().any()
                atol = 1e-4 if dtype == torch.float32 else 3e-2 * expected.abs().max().item()
                torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)
                assert torch.equal(got[case.base_rows], case.out0[case.base_rows])
