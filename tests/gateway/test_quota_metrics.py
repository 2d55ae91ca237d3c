"""The tenants' quotas on /metrics, read from the gateway's quota at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from support.prometheus_scrape import Scrape

from services.gateway.quota_metrics import QuotaMetrics
from services.gateway.tenant_quota import QuotaConfig, TenantLimits, TenantQuota


def test_slots_waiting_and_tokens_per_tenant():
    limits = {"alice": TenantLimits(max_concurrent_requests=2, tokens_per_minute=600),
              "*": TenantLimits(max_concurrent_requests=1)}  # fmt: skip
    quota = TenantQuota(QuotaConfig(limits), clock=lambda: 1000.0)
    registry = CollectorRegistry()
    registry.register(QuotaMetrics(lambda: quota))

    def scrape() -> Scrape:
        return Scrape(generate_latest(registry).decode())

    idle = scrape()
    assert idle.by_label("loramesh_gateway_tenant_requests_in_flight", "tenant") == {"alice": 0}
    assert idle.value("loramesh_gateway_tenant_tokens_available", tenant="alice") == 600
    alice = quota.admit("alice", 100)
    carol = quota.admit("carol", 10)  # limited by "*": shown while she has one in flight
    busy = scrape()
    assert busy.by_label("loramesh_gateway_tenant_requests_in_flight", "tenant") == {"alice": 1, "carol": 1}
    assert busy.by_label("loramesh_gateway_tenant_requests_waiting", "tenant") == {"alice": 0, "carol": 0}
    assert busy.by_label("loramesh_gateway_tenant_tokens_available", "tenant") == {"alice": 500}
    alice.settle(40)
    carol.settle(10)
    assert scrape().by_label("loramesh_gateway_tenant_tokens_available", "tenant") == {"alice": 560}
    assert scrape().by_label("loramesh_gateway_tenant_requests_in_flight", "tenant") == {"alice": 0}
