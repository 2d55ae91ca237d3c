"""`python -m bench.gpu_checklist` runs end to end on a CPU (its dry run before GPU time is spent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_quick_dry_run_writes_the_expected_json(tmp_path: Path) -> None:
    # A process of its own: importing Triton here would fix its interpreter setting for the
    # kernel tests. No timeout: --quick bounds the work (a 4-layer random model, a few cases).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_checklist", "--device", "cpu", "--quick", "--parts", "1",
         "--model", "random", "--out", str(tmp_path)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "# GPU checklist" in done.stdout
    result = json.loads((tmp_path / "gpu_checklist.json").read_text())
    assert {"device", "torch", "triton", "quick", "model", "seconds"} <= set(result["meta"])
    assert result["meta"]["model"].startswith("random init")
    part = result["parts"]["1"]
    assert set(part) >= {"kernels", "engine_vs_hf_fp32", "engine_vs_hf_bf16", "seconds"}
    errors = {name: p["error"] for name, p in part.items() if isinstance(p, dict) and "error" in p}
    assert not errors, errors
    kernels = part["kernels"]
    assert kernels["triton"].startswith("skipped")  # no CUDA, no interpreter
    assert kernels["pass"] and {c["backend"] for c in kernels["cases"]} == {"torch", "padded_bmm"}
    fp32 = part["engine_vs_hf_fp32"]
    assert fp32["pass"], fp32
    assert len(fp32["requests"]) == 4 and all(r["steps"] == fp32["new_tokens"] for r in fp32["requests"])
    assert "identical" in part["engine_vs_hf_bf16"]
