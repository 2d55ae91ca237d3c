"""``/metrics`` shows when each TLS certificate a process presents expires (the expiry alert's
series), and the new date once a certificate is replaced."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from cryptography import x509
from support.prometheus_scrape import Scrape

from services.runtime.metrics import ServiceMetrics
from services.runtime.security.certificate_reload import certificate_files
from services.runtime.security.certificates import create_mesh_certificates

SERIES = "loramesh_tls_certificate_expiry_timestamp_seconds"


def not_after(path) -> float:
    return x509.load_pem_x509_certificate(Path(path).read_bytes()).not_valid_after_utc.timestamp()


def install(tls, directory: Path) -> None:
    for source, target in ((tls.ca_file, "ca"), (tls.cert_file, "cert"), (tls.key_file, "key")):
        shutil.copy(source, directory / target)


async def test_the_expiry_of_the_certificate_in_use_is_a_gauge(tmp_path):
    long = create_mesh_certificates(tmp_path / "long", ("gateway",)).tls_for("gateway")
    short = create_mesh_certificates(
        tmp_path / "short", ("gateway",), validity=datetime.timedelta(hours=2)
    ).tls_for("gateway")
    live = tmp_path / "live"
    live.mkdir()
    install(long, live)
    files = certificate_files(str(live / "ca"), str(live / "cert"), str(live / "key"))
    metrics = ServiceMetrics("gateway")

    async def expiry() -> float:
        return Scrape((await metrics.exposition()).decode()).value(SERIES, certificate=str(live / "cert"))

    assert await expiry() == not_after(live / "cert")
    install(short, live)
    assert files.check()
    assert await expiry() == not_after(live / "cert") < not_after(long.cert_file)
