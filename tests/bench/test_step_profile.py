"""The step profile's structure on the tiny random Llama: every component, the roofline fields."""

from __future__ import annotations

import math

import torch

from bench.step_profile import COMPONENTS, markdown, measure_roofline, run_profile
from services.gpu_worker.model.loading import load_model
from services.model_files.base_model import load_base_model_spec


def test_profile_parts_add_up_to_the_step(model_dir, one_thread):
    roofline = measure_roofline(mib=4, gemm_size=64, repeats=1)
    report = run_profile(
        load_model(model_dir),
        load_base_model_spec(model_dir),
        torch.float32,
        batches=[1, 2],
        prompt_len=4,
        steps=2,
        warmup=1,
        roofline=roofline,
    )

    assert roofline.read_gb_s_one_thread > 0 and roofline.read_gb_s_all_threads > 0
    assert set(roofline.gemm_gflop_s) == {"float32", "bfloat16"}
    assert [(p.batch, p.adapters) for p in report.profiles] == [(1, 0), (1, 1), (2, 0), (2, 2)]
    for profile in report.profiles:
        assert set(profile.components_ms) == set(COMPONENTS)
        assert all(ms >= 0 for ms in profile.components_ms.values())
        assert sum(profile.components_ms.values()) <= profile.timed_step_ms * (1 + 1e-9)
        assert profile.step_ms > 0 and profile.weight_bytes > 0
        assert (profile.adapter_bytes > 0) == (profile.adapters > 0)
        assert all(
            math.isfinite(share) and share >= 0
            for share in (profile.bandwidth_share, profile.flops_share, profile.base_gemm_bandwidth_share)
        )
    assert markdown(report).count("\n| ") == len(report.profiles) + 1
