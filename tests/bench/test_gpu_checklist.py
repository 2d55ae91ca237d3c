"""bench/gpu_checklist.py runs end to end on a CPU (its dry run before GPU time is spent)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_checklist import main


def test_cpu_quick_dry_run_writes_the_expected_json(tmp_path: Path, capsys, monkeypatch) -> None:
    # In-process and bounded (--quick: a 4-layer random model, a few cases): no clock in the verdict.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    main(["--device", "cpu", "--quick", "--parts", "1", "--model", "random", "--out", str(tmp_path)])
    assert "# GPU checklist" in capsys.readouterr().out
    result = json.loads((tmp_path / "gpu_checklist.json").read_text())
    assert {"device", "torch", "triton", "quick", "model", "seconds"} <= set(result["meta"])
    assert result["meta"]["model"].startswith("random init")
    part = result["parts"]["1"]
    assert set(part) >= {"kernels", "engine_vs_hf_fp32", "engine_vs_hf_bf16", "seconds"}
    errors = {name: p["error"] for name, p in part.items() if isinstance(p, dict) and "error" in p}
    assert not errors, errors
    kernels = part["kernels"]
    # No CUDA: Triton is skipped, unless an earlier test of this process left its interpreter on.
    backends = {c["backend"] for c in kernels["cases"]}
    assert kernels["pass"] and backends >= {"torch", "padded_bmm"}
    assert kernels["triton"].startswith("skipped") or backends > {"torch", "padded_bmm"}
    fp32 = part["engine_vs_hf_fp32"]
    assert fp32["pass"], fp32
    assert len(fp32["requests"]) == 4 and all(r["steps"] == fp32["new_tokens"] for r in fp32["requests"])
    assert "identical" in part["engine_vs_hf_bf16"]
