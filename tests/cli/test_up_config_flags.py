"""`loramesh up`'s flags for its services' settings come from the services' config classes
(loramesh_cli/config_flags.py): each flag has the field's name, type, help and default, is passed
on only when given (or when `up` has a default of its own), and every flag `up` passes on is one
the service's own parser reads back as the value given."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_type_hints

import pytest

from loramesh_cli import mesh_layout, up_arguments
from loramesh_cli.config_flags import ForwardedSettings, flag
from loramesh_cli.main import build_parser
from loramesh_cli.mesh_layout import service_processes
from loramesh_cli.up_arguments import SERVICE_SETTINGS, STORE_SETTINGS, WORKER_SETTINGS, detached_argv
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import field_docs, parse_config


def other_value(group: ForwardedSettings, name: str) -> tuple[str, object]:
    """A value of the setting other than the service's default: as typed, and as it parses."""
    default = getattr(group.config, name)
    kind = get_type_hints(group.config)[name]
    if kind is bool:
        return ("off", False) if default else ("on", True)
    if name in group.choices:
        chosen = min(c for c in group.choices[name] if c != default)
        return chosen, chosen
    if kind is str:
        return "elsewhere/model.gguf", "elsewhere/model.gguf"
    value = kind(default) / 4 if kind is float else default + 3  # within every range: 0.125, 1.5
    return str(value), value


def every_setting() -> list[tuple[str, str, object]]:
    """Each setting `up` takes once, with another value than its service's default."""
    seen: dict[str, tuple[str, object]] = {}
    for group in SERVICE_SETTINGS:
        for name in group.names:
            seen.setdefault(name, other_value(group, name))
    return [(name, typed, parsed) for name, (typed, parsed) in seen.items()]


def configs_by_service(tmp_path, *flags: str) -> dict[str, list]:
    """What each service's processes parse from the command lines `up` builds (environ empty)."""
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", *flags])
    processes, _ = service_processes(args, tmp_path, tmp_path, "127.0.0.1:2379", tmp_path / "keys.json", None)
    configs: dict[str, list] = {}
    for group in SERVICE_SETTINGS:
        for process in processes.values():
            if process.module == group.service:
                command = process.command()
                argv = command[command.index(f"services.{group.service}") + 1 :]
                configs.setdefault(group.service, []).append(parse_config(group.config, argv, environ={}))
    return configs


def test_every_setting_up_takes_reaches_its_services_as_given(tmp_path):
    settings = every_setting()
    flags = [token for name, typed, _ in settings for token in (flag(name), typed)]
    configs = configs_by_service(tmp_path, *flags)
    for group in SERVICE_SETTINGS:
        assert configs[group.service], group.service
        for config in configs[group.service]:
            got = {name: getattr(config, name) for name in group.names}
            expected = {name: parsed for name, _, parsed in settings if name in group.names}
            if (
                "blob_store" in expected
            ):  # a directory, made absolute by up (the stores' working directory may differ)
                expected["blob_store"] = str(Path(expected["blob_store"]).resolve())
            assert got == expected
    # The background `up` of --detach is given the same.
    args = build_parser().parse_args(["--state-dir", str(tmp_path), "up", *flags])
    argv = detached_argv(args, tmp_path)
    again = build_parser().parse_args(argv[argv.index("--state-dir") :])
    assert all(getattr(again, name) == getattr(args, name) is not None for name, _, _ in settings)


def test_without_them_the_services_keep_their_defaults(tmp_path):
    """Only the settings `up` has a default of its own for are passed: the workers' 512 MiB pool
    (half the service's 1024: the mesh's workers share one machine with the other services), the
    overflow policy (borrow, since `up` runs kv_managers) and the stores' blob directory (one in
    the state directory that every replica shares)."""
    configs = configs_by_service(tmp_path)
    up_own = {
        WORKER_SETTINGS.service: {"pool_mib": 512, "kv_overflow": "borrow"},
        STORE_SETTINGS.service: {"blob_store": str(tmp_path / "adapter_store")},
    }
    for group in SERVICE_SETTINGS:
        for config in configs[group.service]:
            own = up_own.get(group.service, {})
            for name in group.names:
                assert getattr(config, name) == own.get(name, getattr(group.config, name)), name
    assert WorkerConfig.pool_mib == 1024


def test_a_setting_named_once_reaches_up_help_and_the_workers(tmp_path, monkeypatch, capsys):
    """Exposing one more worker setting is adding its name: `up --help` shows it with the field's
    docstring and the worker's default, and the workers get it."""
    more = dataclasses.replace(WORKER_SETTINGS, names=(*WORKER_SETTINGS.names, "max_running"))
    monkeypatch.setattr(up_arguments, "SERVICE_SETTINGS", (more, *SERVICE_SETTINGS[1:]))
    monkeypatch.setattr(mesh_layout, "WORKER_SETTINGS", more)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-running MAX_RUNNING" in text
    assert f"{field_docs(WorkerConfig)['max_running']} [each gpu_worker; default 64]" in text
    workers = configs_by_service(tmp_path, "--workers", "2", "--max-running", "7")["gpu_worker"]
    assert [w.max_running for w in workers] == [7, 7]
    assert "--max-running" not in detached_argv(build_parser().parse_args(["up"]), tmp_path)


def test_a_switch_is_on_alone_and_takes_on_or_off(tmp_path):
    for flags, expected in ((["--deterministic"], True), (["--deterministic", "off"], False), ([], False)):
        (worker,) = configs_by_service(tmp_path, *flags)["gpu_worker"]
        assert worker.deterministic is expected
