"""Typed config: flags beat env, env beats defaults; every field documented in --help."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.config_refusal import refusal
from support.polling import HANG_GUARD_S

from services.adapter_store.config import AdapterStoreConfig
from services.runtime.config import ServiceConfig, field_docs, parse_config, part_of, setting, settings_of

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("word", ["1", "true", "YES", " On "])
def test_an_on_off_setting_takes_the_words_for_on(word):
    assert parse_config(_Probe, [], environ={"LORAMESH_ENABLED": word}).enabled is True
    assert parse_config(_Probe, ["--enabled", word], environ={}).enabled is True


@pytest.mark.parametrize("word", ["0", "false", "No", "OFF"])
def test_an_on_off_setting_takes_the_words_for_off(word):
    on = {"LORAMESH_ENABLED": "on"}
    assert parse_config(_Probe, [], environ={"LORAMESH_ENABLED": word}).enabled is False
    assert parse_config(_Probe, ["--enabled", word], environ=on).enabled is False


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        ([], {"LORAMESH_ENABLED": "enabled"}, "LORAMESH_ENABLED (setting --enabled): expected on (1, true"),
        (["--enabled", "enabled"], {}, "argument --enabled: expected on (1, true, yes, on) or off (0, false"),
        ([], {"LORAMESH_ENABLED": ""}, "LORAMESH_ENABLED (setting --enabled): expected on"),
        (
            [],
            {"LORAMESH_PORT": "eighty"},
            "LORAMESH_PORT (setting --port): expected an integer, got 'eighty'",
        ),
        ([], {"LORAMESH_RATIO": "half"}, "LORAMESH_RATIO (setting --ratio): expected a number, got 'half'"),
        (["--port", "70000"], {}, "--port (env LORAMESH_PORT) must be in [0, 65535], got 70000"),
        (["--lease-ttl-s", "0"], {}, "--lease-ttl-s (env LORAMESH_LEASE_TTL_S) must be at least 1, got 0"),
        (["--grace-s", "nan"], {}, "--grace-s (env LORAMESH_GRACE_S) must be at least 0, got nan"),
        (["--log-format", "xml"], {}, "--log-format (env LORAMESH_LOG_FORMAT) must be one of text, json"),
        (["--log-level", "loud"], {}, "--log-level (env LORAMESH_LOG_LEVEL) must be one of"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_the_setting(capsys, argv, environ, named):
    """Fail closed: a value that is not one of the setting's is no reason to run on a default."""
    assert named in refusal(capsys, _Probe, argv, environ)


def test_a_services_entrypoint_refuses_a_bad_boolean_before_it_starts():
    """The scheduler's ``python -m`` entry, as an operator runs it: exit 2 and the setting named,
    without etcd or any port (it never gets that far)."""
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler"],
        env={**os.environ, "LORAMESH_FREEZE_STARTUP_OBJECTS": "enabled"},
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=False, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "python -m services.scheduler: error: LORAMESH_FREEZE_STARTUP_OBJECTS (setting "
        "--freeze-startup-objects): expected on (1, true, yes, on) or off (0, false, no, off), got 'enabled'"
    )
