"""Typed config: flags beat env, env beats defaults; every field documented in --help."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.adapter_store.config import AdapterStoreConfig
from services.runtime.config import ServiceConfig, field_docs, parse_config


@dataclass
class _Probe(ServiceConfig):
    """A probe service."""

    ratio: float = 0.5
    """How much."""
    enabled: bool = False
    """Whether."""


def test_defaults_env_and_flags_in_that_order():
    assert parse_config(_Probe, [], environ={}).ratio == 0.5
    env = {"LORAMESH_RATIO": "0.25", "LORAMESH_ENABLED": "true", "LORAMESH_PORT": "7000"}
    from_env = parse_config(_Probe, [], environ=env)
    assert (from_env.ratio, from_env.enabled, from_env.port) == (0.25, True, 7000)
    from_flags = parse_config(_Probe, ["--ratio", "0.75", "--port", "7001"], environ=env)
    assert (from_flags.ratio, from_flags.port, from_flags.enabled) == (0.75, 7001, True)


def test_bad_flag_value_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        parse_config(_Probe, ["--port", "eighty"], environ={})
    assert "--port" in capsys.readouterr().err


def test_every_service_field_is_documented(capsys):
    docs = field_docs(AdapterStoreConfig)
    undocumented = [f for f in AdapterStoreConfig.__dataclass_fields__ if not docs.get(f)]
    assert undocumented == []
    with pytest.raises(SystemExit):
        parse_config(AdapterStoreConfig, ["--help"], environ={})
    out = capsys.readouterr().out
    assert "--ram-budget-mib" in out and "LORAMESH_RAM_BUDGET_MIB" in out and "least recently used" in out
