"""The alert rules ship twice, as a PrometheusRule (k8s/base) and a plain rules file
(monitoring/, for `promtool` and a Prometheus next to `loramesh up`): the same rules, reading
only series that exist and are documented. promtool's own check runs with a real Prometheus
(tests/gateway/http/test_prometheus_scrape.py)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "monitoring" / "loramesh-alerts.yml"
PROMETHEUS_RULE = ROOT / "k8s" / "base" / "prometheus-rule.yaml"
METRICS_DOC = ROOT / "docs" / "metrics.md"
#: What every rule reads that loramesh does not serve: Prometheus's own, etcd's.
FOREIGN = {"up", "etcd_server_has_leader"}
PROMQL_WORDS = {"max", "min", "sum", "by", "or", "and", "on", "rate", "vector", "absent", "time",
                "histogram_quantile", "le", "model_name", "instance", "certificate", "code", "service"}  # fmt: skip


def test_the_prometheus_rule_holds_the_rules_file_groups():
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]


def test_every_alert_reads_documented_series_and_is_documented():
    doc = METRICS_DOC.read_text()
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            assert f"`{rule['alert']}`" in doc, f"{rule['alert']} is not in docs/metrics.md"
            expression = re.sub(r'"[^"]*"', "", rule["expr"])  # label values aside
            names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expression)) - PROMQL_WORDS - FOREIGN
            for name in names:
                series = re.sub(r"_(bucket|count|sum|total)$", "", name)
                assert f"`{series}" in doc, (
                    f"{rule['alert']} reads {name}, which docs/metrics.md does not list"
                )
