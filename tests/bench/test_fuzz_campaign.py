"""The fuzz campaign (bench/fuzz_campaign.py) at its smallest: every entry point, every identity.

The mesh runs as real processes with mutual TLS, without a worker (no model to load: the
gateway's generation calls end in a clear UNAVAILABLE / 503, and the worker's port is fuzzed
in the big run, docs/security.md, "Fuzz campaign"). One generated message and one raw request per
gRPC method and identity, one schemathesis case per HTTP operation, mode and identity, every
hostile adapter as every tenant identity: derandomized, so the same inputs every run.

Asserted: no 5xx, no gRPC UNKNOWN / INTERNAL / DATA_LOSS, every process alive at the end, and
that every entry point was reached as every identity. The loop-lag probe's count is printed,
not asserted: its threshold is a detector, and on a loaded machine a second without a health
check answered can be the machine's doing (bench/fuzz/loop_lag.py).
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

from bench.fuzz import hostile_adapters
from bench.fuzz_campaign import (
    COMMON,
    MESH_IDENTITIES,
    SERVICES,
    TENANTS,
    CampaignConfig,
    report,
    run_campaign,
)
from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from services.model_files.base_model import load_base_model_spec


def test_every_entry_point_as_every_identity(tmp_path, capsys):
    config = CampaignConfig(examples=1, raw_examples=1, worker=False)
    result = run_campaign(tmp_path, config)
    with capsys.disabled():
        print("\n" + "\n".join(report(result)[:1]))
    assert result.failures == 0, "\n".join(result.totals.failure_lines())
    assert result.dead == []
    reached = set(result.totals.outcomes)
    pool = descriptor_pool.Default()
    for service in ("gateway", "adapter_store", "scheduler", "kv_manager"):
        identities = TENANTS if service == "gateway" else MESH_IDENTITIES
        for name in (*SERVICES[service], *COMMON):
            for method in pool.FindServiceByName(name).methods:
                entry = f"gRPC {service} {method.containing_service.name}/{method.name}"
                assert {(entry, i) for i in identities} <= reached, entry
    http = {entry for entry, _ in reached if entry.startswith("HTTP ")}
    assert {
        "HTTP POST /v1/chat/completions",
        "HTTP POST /v1/load_lora_adapter",
        "HTTP POST /generate",
    } <= http
    for entry, identity in {(e, i) for e, i in reached if e in http}:
        assert {(entry, i) for i in TENANTS} <= reached, (entry, identity)
    files = adapter_files(
        write_peft_adapter(tmp_path / "count", load_base_model_spec(), SampleAdapterSpec(rank=8))
    )
    sent = len(hostile_adapters.uploads(files))
    for identity in TENANTS:
        assert sum(result.totals.outcomes["adapter upload (gRPC UploadAdapter)", identity].values()) == sent
