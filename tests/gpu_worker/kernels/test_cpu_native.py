"""The native CPU LoRA kernel against the torch reference at the model's real shapes, and its build.

The batches reuse ``test_lora_kernels``' cases (a NaN-filled pool with every adapter row at a
random place, mixed ranks, rank-0 segments) at SmolLM2's projection widths, with prefill
segments longer than the kernel's 64-token tile and batches of 32 decode tokens.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_lora_kernels import ADAPTER_RANKS, Case, make_case

from services.gpu_worker.kernels import cpu_native, dispatch
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
    assert "cpu_native" not in dispatch.available_backends()
    case = make_case(*DECODE_32, 64, 80, torch.float32)
    got = case.run(lambda *a: dispatch.add_lora_delta(*a, backend="auto"))
    close_to_reference(got, case, case.run(lora_delta_torch))
    with pytest.raises(RuntimeError, match="unavailable"):
        case.run(cpu_native.lora_delta_cpu_native)
