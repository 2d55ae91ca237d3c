"""Typed config: flags beat env, env beats defaults; every field documented in --help."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.adapter_store.config import AdapterStoreConfig
from services.runtime.config import ServiceConfig, field_docs, parse_config, part_of, setting, settings_of


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


@dataclass(frozen=True)
class _Part:
    """Something the probe service builds from its settings."""

    limit: int = 4
    """How many."""
    cap_blocks: int = field(default=-1, metadata=setting("lend_cap"))
    """Taken under another name."""
    owner: str = field(default="local", metadata=setting(None))
    """Derived by the service, no setting."""


@dataclass
@settings_of(_Part)
class _Composed(ServiceConfig):
    """A probe service with a part."""

    own: str = "x"
    """Its own setting."""


def test_a_parts_fields_are_settings_declared_once():
    config = parse_config(_Composed, ["--limit", "9"], environ={"LORAMESH_LEND_CAP": "3"})
    assert (config.own, config.limit, config.lend_cap) == ("x", 9, 3)
    assert (_Composed.limit, _Composed(lend_cap=2).lend_cap) == (4, 2)  # keywords and class defaults
    assert not hasattr(_Composed, "owner") and not hasattr(_Composed, "cap_blocks")
    assert field_docs(_Composed)["lend_cap"] == "Taken under another name."
    assert part_of(config, _Part, owner="me") == _Part(limit=9, cap_blocks=3, owner="me")


def test_a_setting_declared_twice_is_refused():
    with pytest.raises(TypeError, match="_Twice.limit is declared by _Part already"):

        @dataclass
        @settings_of(_Part)
        class _Twice(ServiceConfig):
            limit: int = 5
