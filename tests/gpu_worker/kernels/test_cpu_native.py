"""The native CPU LoRA kernel against the torch reference at the model's real shapes, and its build.

The batches reuse ``test_lora_kernels``' cases (a NaN-filled pool with every adapter row at a
random place, mixed ranks, rank-0 segments) at SmolLM2's projection widths, with prefill
segments longer than the kernel's 64-token tile and batches of 32 decode tokens.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from support.kernel_backends import available_backends
from test_lora_kernels import ADAPTER_RANKS, Case, make_case

from services.gpu_worker.kernels import cpu_native, dispatch
from services.gpu_worker.kernels.lora_segments import AdapterRows, LoraSegments
from services.gpu_worker.kernels.torch_reference import lora_delta_torch

SMOLLM2_FEATURES = ((576, 576), (576, 192), (576, 1536), (1536, 576))
"""(in, out) of SmolLM2-135M's q/o, k/v, gate/up and down projections."""
LONG_PREFILL = ((150, 70, 1, 64), (0, None, 1, 2))
"""Token counts and adapters: a 150-token segment spans three 64-token tiles; then one token and
a 64-token segment that share adapter 1."""
DECODE_32 = ((1,) * 32, tuple(None if i % 7 == 3 else i % len(ADAPTER_RANKS) for i in range(32)))
"""32 decode tokens over all the test adapters round-robin, every seventh without adapter."""


def close_to_reference(got: torch.Tensor, case: Case, expected: torch.Tensor) -> None:
    """Within 1e-5 of the largest delta (both sum in fp32, only the order differs); 16-bit outputs
    may in addition round to the neighbouring value (one ulp of the value). Rows of rank-0
    segments stay bit-identical."""
    assert not got.isnan().any(), "the kernel read outside the adapter rows (the pool is NaN there)"
    delta = (expected.float() - case.out0.float()).abs().max().item()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[got.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5 * delta, rtol=ulp)
    assert torch.equal(got[case.base_rows], case.out0[case.base_rows])


@pytest.fixture(autouse=True)
def needs_native() -> None:
    assert cpu_native.native_available(), cpu_native.native_error()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_f,out_f", SMOLLM2_FEATURES)
@pytest.mark.parametrize("batch", [LONG_PREFILL, DECODE_32], ids=["prefill", "decode"])
def test_native_matches_reference_at_model_shapes(batch, in_f: int, out_f: int, dtype) -> None:
    # x in fp32 (the model's activations on a CPU without bf16 units), pool and out in `dtype`.
    case = make_case(*batch, in_f, out_f, dtype, seed=in_f - out_f, x_dtype=torch.float32)
    close_to_reference(case.run(cpu_native.lora_delta_cpu_native), case, case.run(lora_delta_torch))


@pytest.mark.parametrize("threads", [1, 2])
def test_native_result_does_not_depend_on_threads(threads: int) -> None:
    case = make_case(*DECODE_32, 576, 1536, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = case.run(cpu_native.lora_delta_cpu_native)
    finally:
        torch.set_num_threads(before)
    close_to_reference(got, case, case.run(lora_delta_torch))


def test_native_plan_is_built_once_per_batch() -> None:
    case = make_case(*DECODE_32, 64, 80, torch.float32)
    plan = cpu_native.NativePlan.of(case.seg)
    assert cpu_native.NativePlan.of(case.seg) is plan
    assert plan.num_groups == len(case.seg.groups) == len(ADAPTER_RANKS)
    assert sorted(plan.tokens.tolist()) == [i for i in range(32) if i % 7 != 3]


def test_failed_build_names_the_compiler_error_and_auto_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_native, "CACHE_DIR", tmp_path)
    broken = tmp_path / "broken.c"
    broken.write_text("int lora_delta( {\n")
    monkeypatch.setattr(cpu_native, "SOURCE", broken)
    monkeypatch.setattr(cpu_native, "_library", None)
    with caplog.at_level(logging.WARNING, logger="loramesh.kernels"):
        assert not cpu_native.native_available()
    assert "error" in cpu_native.native_error() and "-fopenmp" in cpu_native.native_error()
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert "cpu_native" not in available_backends()
    case = make_case(*DECODE_32, 64, 80, torch.float32)
    got = case.run(lambda *a: dispatch.add_lora_delta(*a, backend="auto"))
    close_to_reference(got, case, case.run(lora_delta_torch))
    with pytest.raises(RuntimeError, match="unavailable"):
        case.run(cpu_native.lora_delta_cpu_native)


def decode_round_robin(tokens_per_adapter: int, in_f: int, out_f: int, dtype: torch.dtype, **kw) -> Case:
    """A decode batch where every test adapter has ``tokens_per_adapter`` tokens, interleaved, and
    every sixth token has no adapter."""
    n = tokens_per_adapter * len(ADAPTER_RANKS)
    ids = [i % len(ADAPTER_RANKS) for i in range(n)]
    ids[5::6] = [None] * len(ids[5::6])
    return make_case((1,) * n, tuple(ids), in_f, out_f, dtype, **kw)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens_per_adapter", [2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("in_f,out_f", [(576, 1536), (100, 37), (48, 200)])
def test_decode_groups_of_every_size_match_reference(
    tokens_per_adapter: int, in_f: int, out_f: int, pool_dtype
):
    # Groups of 1-2 tokens stream their rows; 3-16 use register tiles of 4 tokens (5 and 7 leave
    # partial tiles); 100, 37 and 200 are not multiples of the tiles' 16-element chunks.
    case = decode_round_robin(tokens_per_adapter, in_f, out_f, pool_dtype, x_dtype=torch.float32)
    case.out0 = case.out0.float()
    close_to_reference(case.run(cpu_native.lora_delta_cpu_native), case, case.run(lora_delta_torch))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_register_tiles_round_half_outputs_once(out_dtype) -> None:
    case = decode_round_robin(4, 192, 80, out_dtype, x_dtype=torch.float32)
    close_to_reference(case.run(cpu_native.lora_delta_cpu_native), case, case.run(lora_delta_torch))


def scattered_segments(
    in_f: int, out_features: tuple[int, ...], ranks: tuple[int, ...], tokens_per_adapter: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[LoraSegments]]:
    """One pool holding adapters of ``ranks`` for each output width (rows in random order), x, and
    one decode batch per width in which every adapter has ``tokens_per_adapter`` tokens."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(len(out_features) * sum(ranks) * (in_f + max(out_features)) + 7, generator=g)
    order = [i % len(ranks) for i in range(tokens_per_adapter * len(ranks))]
    offset, segments = 7, []
    for out_f in out_features:
        adapters = []
        for r in ranks:
            a_off = offset + in_f * torch.randperm(r, generator=g)
            offset += r * in_f
            b_off = offset + out_f * torch.randperm(r, generator=g)
            offset += r * out_f
            adapters.append(AdapterRows(a_off.long(), b_off.long()))
        scales = [0.5 + i / 8 for i in order]
        segments.append(
            LoraSegments.build([1] * len(order), [adapters[i] for i in order], scales, in_f, out_f, "cpu")
        )
    return pool, torch.randn(len(order), in_f, generator=g), segments


def test_odd_ranks_in_register_tiles() -> None:
    # Tiles take A rows two at a time: ranks 3, 5, 1 and 7 leave a row over.
    pool, x, (seg,) = scattered_segments(64, (48,), (3, 5, 1, 7), tokens_per_adapter=4, seed=3)
    expected, got = torch.zeros(x.shape[0], 48), torch.zeros(x.shape[0], 48)
    lora_delta_torch(x, pool, seg, expected)
    cpu_native.lora_delta_cpu_native(x, pool, seg, got)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_one_call_serves_several_projections_of_one_input(pool_dtype) -> None:
    # q, k and v read the same x: one call with three (segments, out) pairs, as the model makes it.
    pool, x, segments = scattered_segments(576, (576, 192, 37), (8, 16, 32, 64), tokens_per_adapter=4, seed=1)
    pool = pool.to(pool_dtype)
    outs = [torch.randn(x.shape[0], seg.out_features) for seg in segments]
    expected = [out.clone() for out in outs]
    cpu_native.lora_deltas_cpu_native(x, pool, list(zip(segments, outs)))
    for seg, out, before in zip(segments, outs, expected):
        reference = before.clone()
        lora_delta_torch(x, pool, seg, reference)
        # Both sum in fp32 and differ only in order: within 1e-5 of the largest delta.
        delta = (reference - before).abs().max().item()
        torch.testing.assert_close(out, reference, atol=1e-5 * delta, rtol=0)


def test_problems_of_one_call_must_share_the_input_width() -> None:
    pool, x, (wide,) = scattered_segments(96, (64,), (8, 16), tokens_per_adapter=3, seed=2)
    _, _, (narrow,) = scattered_segments(64, (64,), (8, 16), tokens_per_adapter=3, seed=2)
    out = torch.zeros(x.shape[0], 64)
    with pytest.raises(ValueError, match="same x"):
        cpu_native.lora_deltas_cpu_native(x, pool, [(wide, out), (narrow, out.clone())])


def test_a_call_without_problems_or_groups_changes_nothing() -> None:
    pool, x, _ = scattered_segments(64, (48,), (8,), tokens_per_adapter=3, seed=4)
    cpu_native.lora_deltas_cpu_native(x, pool, [])
    base_only = LoraSegments.build([1] * x.shape[0], [None] * x.shape[0], [1.0] * x.shape[0], 64, 48, "cpu")
    out = torch.randn(x.shape[0], 48)
    before = out.clone()
    cpu_native.lora_deltas_cpu_native(x, pool, [(base_only, out)])
    assert torch.equal(out, before)


def test_inputs_of_the_wrong_shape_are_refused_and_later_calls_still_work() -> None:
    # A call's C arguments are prepared once per segments and reused: a refused call must leave
    # them usable, and a shape the segments do not describe must never reach the kernel.
    pool, x, (seg,) = scattered_segments(96, (64,), (8, 16), tokens_per_adapter=3, seed=5)
    out = torch.zeros(x.shape[0], 64)
    with pytest.raises(ValueError, match="x must be"):
        cpu_native.lora_deltas_cpu_native(x[:-1], pool, [(seg, out)])
    with pytest.raises(ValueError, match="out must be"):
        cpu_native.lora_deltas_cpu_native(x, pool, [(seg, out[:, :32])])
    assert not out.any()
    expected = out.clone()
    lora_delta_torch(x, pool, seg, expected)
    cpu_native.lora_deltas_cpu_native(x, pool, [(seg, out)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_prepared_call_keeps_what_its_pointers_point_into() -> None:
    # The C structs hold raw pointers into the segments' tensors (row offsets, plan, tokens): a
    # call prepared and kept by itself, with every other reference to its segments gone, must
    # still read them, not freed memory.
    pool, x, (seg,) = scattered_segments(96, (64,), (8, 16), tokens_per_adapter=3, seed=7)
    expected = torch.zeros(x.shape[0], 64)
    lora_delta_torch(x, pool, seg, expected)
    call = cpu_native.NativeCall((seg,))
    del seg
    gc.collect()
    # New tensors of the same sizes would take the freed blocks; fill them with garbage offsets.
    litter = [torch.full((n,), 1 << 40, dtype=torch.int64) for n in (8, 16, 24, 7, 9) for _ in range(8)]
    out = torch.zeros(x.shape[0], 64)
    call.run(x, [out], pool)
    del litter
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_strided_out_gets_the_delta_through_a_copy() -> None:
    pool, x, (seg,) = scattered_segments(96, (64,), (8, 16), tokens_per_adapter=3, seed=6)
    fused = torch.randn(x.shape[0], 128)
    out = fused[:, 32:96]  # a view into a wider row, as a split fused projection would give
    expected = out.clone()
    lora_delta_torch(x, pool, seg, expected)
    cpu_native.lora_deltas_cpu_native(x, pool, [(seg, out)])
    torch.testing.assert_close(fused[:, 32:96], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu_native", "torch"])
def test_step_lora_prepares_each_call_once_and_skips_untargeted_projections(backend) -> None:
    # The model's q/k/v call when the adapters target q and v only: k gets nothing, and the second
    # step reuses the prepared call with new tensors (the engine allocates x and outs every step).
    pool, x, (q_seg, v_seg) = scattered_segments(96, (64, 32), (8, 16), tokens_per_adapter=3, seed=7)
    step_lora = dispatch.StepLora([{"q_proj": q_seg, "v_proj": v_seg}])
    names = ("q_proj", "k_proj", "v_proj")
    for step in range(2):
        xs = x + step
        outs = (torch.randn(x.shape[0], 64), torch.randn(x.shape[0], 48), torch.randn(x.shape[0], 32))
        before = [out.clone() for out in outs]
        step_lora.add_deltas(0, names, xs, outs, pool, backend)
        for seg, out, old in ((q_seg, outs[0], before[0]), (v_seg, outs[2], before[2])):
            expected = old.clone()
            lora_delta_torch(xs, pool, seg, expected)
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
        assert torch.equal(outs[1], before[1])
    assert len(step_lora._prepared) == 1
