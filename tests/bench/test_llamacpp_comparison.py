"""`loramesh bench --systems loramesh-up llamacpp llamacpp-base`: refused in one line before
anything runs when no llama-server is configured, and reported round by round with loramesh-up's
throughput over each llama.cpp system's."""

from __future__ import annotations

import pytest

from bench.serving.profiles import LLAMACPP, LLAMACPP_BASE, LORAMESH_UP
from bench.serving.report import llamacpp_comparison
from bench.serving.system_settings import LLAMA_SERVER_ENV
from loramesh_cli.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--systems", LORAMESH_UP, LLAMACPP],
            "the llamacpp systems need llama-server: pass --llama-server PATH",
        ),
        (["--systems", "llama"], "unknown system(s) llama; known:"),
        (["--systems", LLAMACPP, "--llama-server", "/nonexistent/llama-server"], "no llama-server binary at"),
        (["--repeat", "0"], "--repeat must be at least 1"),
    ],
)
def test_a_comparison_that_cannot_run_is_refused_in_one_line(argv, message, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def run(system: str, round_index: int, tokens_per_s: float) -> dict:
    return {
        "system": system,
        "round": round_index,
        "sweeps": ["llamacpp"],
        "metrics": {"throughput_tps": tokens_per_s, "slo_attainment": 0.5},
    }


def test_the_report_gives_each_rounds_ratios_and_their_mean():
    results = {
        "runs": [
            run(LORAMESH_UP, 0, 60.0), run(LLAMACPP, 0, 30.0), run(LLAMACPP_BASE, 0, 120.0),
            run(LORAMESH_UP, 1, 40.0), run(LLAMACPP, 1, 40.0), run(LLAMACPP_BASE, 1, 80.0),
        ]
    }  # fmt: skip
    text = "\n".join(llamacpp_comparison(results))
    assert "| 1 | 60.0 (50%) | 30.0 (50%) | 120.0 (50%) | **2.00×** | **0.50×** |" in text
    assert "| 2 | 40.0 (50%) | 40.0 (50%) | 80.0 (50%) | **1.00×** | **0.50×** |" in text
    assert "loramesh-up ÷ llamacpp: 1.50× mean of 2; loramesh-up ÷ llamacpp-base: 0.50× mean of 2" in text


def test_without_loramesh_up_there_is_no_comparison():
    assert llamacpp_comparison({"runs": [run(LLAMACPP, 0, 30.0)]}) == []
