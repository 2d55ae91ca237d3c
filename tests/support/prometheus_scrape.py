"""Scraping a service's ``/metrics`` over HTTP, as Prometheus does, into metric families by name."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class Scrape:
    """One scrape: every sample, looked up by series name and labels."""

    def __init__(self, text: str):
        self.text = text
        families = list(text_string_to_metric_families(text))
        self.family_names = {family.name for family in families}
        """Every metric family served, those with no series now included (counters without
        ``_total``, histograms without ``_bucket``...)."""
        self.samples: list[Sample] = [sample for family in families for sample in family.samples]

    def series(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the one series ``name`` whose labels include ``labels``; None if absent."""
        found = [s.value for s in self.series(name) if labels.items() <= s.labels.items()]
        if len(found) > 1:
            raise AssertionError(f"{len(found)} series {name}{labels}; name them all")
        return found[0] if found else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: sample value}`` over the series ``name``."""
        return {s.labels[label]: s.value for s in self.series(name)}


async def scrape(http_address: str) -> Scrape:
    host, port = http_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    if head.split()[1] != "200":
        raise AssertionError(f"/metrics answered {head.splitlines()[0]}")
    return Scrape(body)
