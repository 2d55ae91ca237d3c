"""What each worker runs, as `loramesh up` says it once ready: read from the workers' load
reports in a real etcd, worded as weights' format and activation dtype."""

from __future__ import annotations

import pytest

from loramesh_cli.worker_formats import describe_format, read_worker_formats
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig
from services.runtime.security.tls import NO_TLS

HANG_GUARD_S = 60.0  # not a timing claim: the first report comes within a second


def test_the_words():
    assert describe_format({"quantization": "q4_1", "dtype": "bfloat16"}) == (
        "weights q4_1 (quantized blocks), activations bfloat16"
    )
    assert describe_format({"quantization": "none", "dtype": "float32"}) == (
        "weights float32 (unquantized), activations float32"
    )
    assert describe_format({"queue": 0}) == ""  # a report of a worker that says neither


@pytest.mark.integration
async def test_read_from_the_load_reports(etcd):
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    report = {"quantization": "none", "dtype": "bfloat16"}
    worker = MemberInfo.create("gpu_worker", "127.0.0.1:1", instance_id="gpu_worker-0")
    registration = await MemberRegistration(config, worker, load_fn=lambda: report).start()
    try:
        found = await read_worker_formats(etcd.endpoint, NO_TLS, ["gpu_worker-0"], wait_s=HANG_GUARD_S)
        assert found == {"gpu_worker-0": "weights bfloat16 (unquantized), activations bfloat16"}
        # One that has not reported is left out once the wait is over (here: none).
        both = await read_worker_formats(etcd.endpoint, NO_TLS, ["gpu_worker-0", "gpu_worker-1"], wait_s=0)
        assert both == found
    finally:
        await registration.stop()
