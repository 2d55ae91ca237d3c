"""The tenants' quotas on ``/metrics``: per tenant, the generations holding a slot and waiting for
one, and what the tenant's token bucket holds, read at scrape time from the gateway's
:class:`~services.gateway.tenant_quota.TenantQuota` (docs/metrics.md). Refusals are counted in
``loramesh_gateway_generations_total{code="RESOURCE_EXHAUSTED"}``
(:mod:`services.gateway.request_metrics`).

Tenants are labelled by name: the tenants file bounds them. A tenant appears while it has a
limit in the file or a generation in flight or waiting on this gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from services.gateway.tenant_quota import TenantQuota


class QuotaMetrics:
    """The collector; ``quota``: the gateway's quota now (replaced in tests)."""

    def __init__(self, quota: Callable[[], TenantQuota]):
        self._quota = quota

    def collect(self) -> Iterator[Metric]:
        quota = self._quota()
        in_flight = GaugeMetricFamily(
            "loramesh_gateway_tenant_requests_in_flight",
            "Generations of the tenant holding a slot on this gateway (limited tenants only)",
            labels=["tenant"],
        )
        waiting = GaugeMetricFamily(
            "loramesh_gateway_tenant_requests_waiting",
            "Generations of the tenant waiting on this gateway for a max_concurrent_requests slot",
            labels=["tenant"],
        )
        tokens = GaugeMetricFamily(
            "loramesh_gateway_tenant_tokens_available",
            "Tokens the tenant's tokens_per_minute bucket holds on this gateway (negative: in debt)",
            labels=["tenant"],
        )
        for tenant in quota.tenants():
            in_flight.add_metric([tenant], quota.in_flight(tenant))
            waiting.add_metric([tenant], quota.waiting(tenant))
            left = quota.tokens_left(tenant)
            if left is not None:
                tokens.add_metric([tenant], left)
        yield from (in_flight, waiting, tokens)
