"""A real Prometheus (Debian's ``prometheus``, started on loopback with a temporary store) running
the shipped scrape config (``monitoring/prometheus-up.yml``) and alert rules against a state
directory's targets file, as ``loramesh up`` writes it; scraping every second."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import yaml
from support.polling import poll_until

from loramesh_cli.prometheus_targets import TARGETS_FILE_NAME
from services.runtime.process.ports import free_port

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
SCRAPE_CONFIG = MONITORING / "prometheus-up.yml"
ALERTS = MONITORING / "loramesh-alerts.yml"

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Debian's prometheus (make setup)"
)

Query = Callable[[str], Awaitable[dict[str, float]]]
"""PromQL -> {the result's ``adapter`` label ("" without one): its value}."""


def shipped_config(state_dir: Path) -> dict:
    """The shipped scrape config, pointed at ``state_dir``'s targets file, scraping every second."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    (job,) = config["scrape_configs"]
    (file_sd,) = job["file_sd_configs"]
    file_sd["files"] = [str(state_dir / TARGETS_FILE_NAME)]
    return config


@contextlib.asynccontextmanager
async def running_prometheus(
    state_dir: Path, work_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Query]]:
    """Prometheus over ``state_dir``'s targets, its files in ``work_dir``: its API client and a
    query function."""
    config = work_dir / "prometheus.yml"
    config.write_text(yaml.safe_dump(shipped_config(state_dir)))
    port = free_port()
    log = (work_dir / "prometheus.log").open("wb")
    prometheus = await asyncio.create_subprocess_exec(
        "prometheus", f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as api:

            async def ready() -> int:
                try:
                    return (await api.get("/-/ready")).status_code
                except httpx.TransportError:  # not listening yet
                    return 0

            # Listening comes before ready: until its store is open it answers 503 to queries.
            await poll_until(ready, lambda status: status == 200, "Prometheus is ready")

            async def query(promql: str) -> dict[str, float]:
                answer = (await api.get("/api/v1/query", params={"query": promql})).json()
                return {
                    r["metric"].get("adapter", ""): float(r["value"][1]) for r in answer["data"]["result"]
                }

            yield api, query
    finally:
        prometheus.terminate()
        await prometheus.wait()
        log.close()
