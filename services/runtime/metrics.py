"""Prometheus metrics owned by one service instance, and the HTTP side port that serves them.

Each service instance has its own registry (several services can share a process in tests).
The side port answers ``/healthz`` (process alive), ``/readyz`` (ready to serve) and
``/metrics`` (Prometheus text format) with a tiny asyncio HTTP/1.1 responder.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from ssl import SSLContext

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from services.runtime.security.certificate_reload import certificate_expiries

log = logging.getLogger("loramesh.http")


class ServiceMetrics:
    """The registry of one service plus the RPC metrics every service has."""

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry()
        self.rpc_total = Counter(
            "loramesh_rpc_total",
            "RPCs handled, by method and final status code",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            "loramesh_rpc_seconds",
            "RPC handling time in seconds (streams: until the last message)",
            ["service", "method"],
            registry=self.registry,
        )
        self.registry.register(_CertificateExpiryCollector())

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_total.labels(self.service, method, code).inc()
        self.rpc_seconds.labels(self.service, method).observe(seconds)

    def export_load_report(self, load_fn: Callable[[], dict]) -> None:
        """Expose every number of the service's load report as a gauge ``loramesh_<service>_<key>``
        (lists as their length), read at scrape time: the report etcd gets is what Prometheus gets."""
        self.registry.register(_LoadReportCollector(self.service, load_fn))

    def export_service(self, service: object) -> None:
        """Expose ``service``'s load report and, when it has them (``metric_collectors()``), its
        own collectors: series richer than a load report's numbers (labels, histograms). A
        service with an HTTP API of its own (``serve_metrics(metrics)``: the gateway's OpenAI
        port) is handed these metrics to serve there too, as vLLM serves ``/metrics``."""
        self.export_load_report(service.load_report)
        for collector in getattr(service, "metric_collectors", tuple)():
            self.registry.register(collector)
        serve = getattr(service, "serve_metrics", None)
        if serve is not None:
            serve(self)

    async def exposition(self) -> bytes:
        """The registry in Prometheus text format. Collectors read state the event loop owns, so
        they run here; formatting the text, most of a large scrape's time, runs on a thread
        instead of blocking the loop."""
        families = _Collected(list(self.registry.collect()))
        return await asyncio.to_thread(generate_latest, families)


class _LoadReportCollector:
    def __init__(self, service: str, load_fn: Callable[[], dict]):
        self.service = service
        self.load_fn = load_fn

    def collect(self):
        for key, value in self.load_fn().items():
            if isinstance(value, list):
                value = len(value)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            yield GaugeMetricFamily(
                f"loramesh_{self.service}_{key}", f"{self.service} load report: {key}", value
            )


class _CertificateExpiryCollector:
    """When each TLS certificate the process presents expires (none without TLS), read at
    scrape time: a rotated certificate shows its new date at the next scrape."""

    def collect(self):
        family = GaugeMetricFamily(
            "loramesh_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate in use expires (Unix seconds), by certificate file",
            labels=["certificate"],
        )
        for path, expiry in sorted(certificate_expiries().items()):
            family.add_metric([path], expiry)
        yield family


class _Collected:
    """Metric families already collected, as a registry for ``generate_latest``."""

    def __init__(self, families: list):
        self._families = families

    def collect(self):
        return iter(self._families)


class HttpSidePort:
    """``/healthz``, ``/readyz`` and ``/metrics`` on their own port: HTTPS only with ``ssl``
    (the service's TLS on: services.runtime.security.certificate_reload.server_ssl_context), else HTTP."""

    def __init__(
        self,
        metrics: ServiceMetrics,
        not_ready: Callable[[], str],
        ssl: SSLContext | None = None,
        degraded: Callable[[], str] = lambda: "",
    ):
        """``not_ready()``: "" while the service is ready, else why not (``/readyz`` says it);
        ``degraded()``: "" or what a ready service cannot do now (e.g. an adapter store cut off
        from etcd serves reads and refuses writes), which ``/readyz`` adds to its answer."""
        self._metrics = metrics
        self._not_ready = not_ready
        self._degraded = degraded
        self._ssl = ssl
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, ssl=self._ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            if why := self._not_ready():
                return 503, "text/plain", f"not ready: {why}\n".encode()
            if limits := self._degraded():
                return 200, "text/plain", f"ready, degraded: {limits}\n".encode()
            return 200, "text/plain", b"ready\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, await self._metrics.exposition()
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request_line = await asyncio.wait_for(reader.readline(), timeout=5)
                while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                    pass
            except ValueError:  # a line past the reader's limit (64 KiB): answered, not dropped
                parts, (status, ctype, body) = [], (431, "text/plain", b"request line or header too long\n")
            else:
                parts = request_line.decode("latin-1").split()
                if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                    status, ctype, body = 405, "text/plain", b"method not allowed\n"
                else:
                    status, ctype, body = await self._route(parts[1].split("?", 1)[0])
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
                      503: "Service Unavailable"}  # fmt: skip
            head = (
                f"HTTP/1.1 {status} {reason[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            # The body as Content-Length announces it, except to HEAD.
            writer.write(head.encode() + (b"" if parts and parts[0] == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
