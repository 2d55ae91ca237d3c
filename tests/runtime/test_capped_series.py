"""Histograms and counters per adapter, capped at scrape time: the adapters past the cap are
summed under ``other`` bucket by bucket, so ``other`` stays a valid histogram."""

from __future__ import annotations

from prometheus_client import generate_latest
from support.prometheus_scrape import Scrape

from services.runtime.capped_labels import OTHER, CappedLabels
from services.runtime.capped_series import CappedCounter, CappedHistogram


class _Families:
    def __init__(self, *families):
        self.families = families

    def collect(self):
        return iter(self.families)


def test_adapters_past_the_cap_are_summed_bucket_by_bucket_under_other():
    histogram = CappedHistogram("h_seconds", "help", ("tenant",), (0.1, 1.0))
    histogram.observe("a", ("alice",), 0.05)
    histogram.observe("b", ("alice",), 0.5, times=2)
    histogram.observe("c", ("alice",), 5.0)
    counter = CappedCounter("tokens", "help", ("tenant",))
    counter.inc("a", ("alice",), 3)
    counter.inc("b", ("alice",), 4)
    counter.inc("c", ("bob",), 5)
    capped = CappedLabels(["a", "b", "c"], {"a": 9, "b": 1, "c": 1}, cap=1)
    fixed = {"model_name": "m"}
    scrape = Scrape(
        generate_latest(_Families(histogram.family(capped, fixed), counter.family(capped, fixed))).decode()
    )

    assert scrape.value("h_seconds_bucket", adapter="a", le="0.1") == 1
    assert scrape.value("h_seconds_bucket", adapter=OTHER, le="0.1") == 0
    assert scrape.value("h_seconds_bucket", adapter=OTHER, le="1.0") == 2
    assert scrape.value("h_seconds_bucket", adapter=OTHER, le="+Inf") == 3
    assert scrape.value("h_seconds_count", adapter=OTHER) == 3
    assert scrape.value("h_seconds_sum", adapter=OTHER) == 6.0
    assert scrape.value("h_seconds_count", adapter="a", model_name="m", tenant="alice") == 1
    assert scrape.value("tokens_total", adapter=OTHER, tenant="bob") == 5
    assert scrape.value("tokens_total", adapter=OTHER, tenant="alice") == 4
    assert scrape.value("tokens_total", adapter="a") == 3
