"""The gRPC transport's own bench (issue 30) runs end to end and counts every byte it streamed
(no timing verdict: the streamed work is bounded, 4 MB)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_small_run_reports_each_round_per_mb():
    arguments = ["--mb", "4", "--stream-mb", "1", "--chunk-kib", "256", "--concurrency", "2", "--rounds", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.grpc_stream_ceiling", *arguments],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(run.stdout)
    assert len(report["rounds"]) == 2
    for round_ in report["rounds"]:
        assert round_["mb_received"] == 4  # the server's count, over every stream
        assert round_["mb_per_s"] > 0
        assert round_["server_cpu_ms_per_mb"] >= 0 and round_["client_cpu_ms_per_mb"] > 0
