"""A real Prometheus (Debian's ``prometheus`` package, started here on loopback with a temporary
store) scrapes the gateway with the shipped scrape config (``monitoring/prometheus-up.yml``, its
targets file as ``loramesh up`` writes it) and evaluates the shipped alert rules. After requests
on two adapters, its query API shows ``vllm:time_to_first_token_seconds`` and the token counters
per adapter. The gateway is the scripted one (conftest.py): a real core, relay and OpenAI app in
front of a worker on loopback that answers from a script; etcd is a real one.

Prometheus scrapes every second here; the test waits for what it needs with poll_until.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml
from support.polling import poll_until
from support.prometheus import ALERTS, SCRAPE_CONFIG, needs_prometheus, running_prometheus

from loramesh_cli.mesh_file import MeshFile, ServiceEntry
from loramesh_cli.prometheus_targets import write_prometheus_targets
from services.runtime.metrics import HttpSidePort

pytestmark = [pytest.mark.integration, needs_prometheus]


def test_promtool_passes_the_shipped_rules_and_scrape_config():
    for command in (["check", "rules", str(ALERTS)], ["check", "config", str(SCRAPE_CONFIG)]):
        result = subprocess.run(
            ["promtool", *command], check=False, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


async def test_prometheus_scrapes_per_adapter_latency_and_tokens(scripted_gateway, etcd, tmp_path):
    gateway = scripted_gateway
    gateway.metrics.registry.register(gateway.core.metrics)  # as the service host does
    side_port = HttpSidePort(gateway.metrics, not_ready=lambda: "")
    port = await side_port.start("127.0.0.1", 0)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    gateway_entry = ServiceEntry("127.0.0.1:1", f"127.0.0.1:{port}", 0, "gateway.log")
    write_prometheus_targets(MeshFile(0, etcd.endpoint, 0, "", {"gateway": gateway_entry}), state_dir)
    try:
        gateway.worker.script = gateway.core.encode(" one two three")
        for model, times in (("pirate", 2), ("bob/shared", 1)):
            for _ in range(times):
                reply = await gateway.http.post(
                    "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 3}
                )
                assert reply.status_code == 200, reply.text

        async with running_prometheus(state_dir, tmp_path) as (api, query):

            def ttft() -> object:
                return query('sum by (adapter) (vllm:time_to_first_token_seconds_count{tenant="alice"})')

            per_adapter = {"alice/pirate": 2.0, "bob/shared": 1.0}
            await poll_until(ttft, lambda got: got == per_adapter, "Prometheus has TTFT counts per adapter")
            tokens = await query("sum by (adapter) (vllm:generation_tokens_total)")
            assert tokens == {"alice/pirate": 6.0, "bob/shared": 3.0}
            prompt = await query("sum by (adapter) (vllm:prompt_tokens_total)")
            assert set(prompt) == set(per_adapter) and all(v > 0 for v in prompt.values())
            assert await query('sum by (adapter) (loramesh_gateway_generations_total{code="OK"})') == {
                "alice/pirate": 2.0, "bob/shared": 1.0,
            }  # fmt: skip
            # etcd is a target too (its client port), labelled as the alert rules read it.
            etcd_up = await poll_until(
                lambda: query('up{service="etcd"} * on() group_left etcd_server_has_leader'),
                lambda got: got != {},
                "Prometheus scrapes etcd",
            )
            assert etcd_up == {"": 1.0}
            rules = (await api.get("/api/v1/rules")).json()["data"]["groups"]
            loaded = {rule["name"] for group in rules for rule in group["rules"]}
            assert loaded == {
                rule["alert"] for rule in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
            }
    finally:
        await side_port.stop()
