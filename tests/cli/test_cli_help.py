"""What `--help` shows: `up`'s flags in a common and an advanced group, every flag of `up`,
`generate` and `chat` with its default, no empty choice anywhere, `demo` as a command and the
development commands under `dev`, out of the top-level list (and still running by their old
names)."""

from __future__ import annotations

import argparse

import pytest

from loramesh_cli import bench_commands, chaos_commands, demo
from loramesh_cli.main import build_parser, subcommand
from services.gpu_worker.engine.engine_config import EngineConfig

ADVANCED = ("--lending-lane", "--lend-compute-share", "--lend-cap-blocks", "--migration", "--placement",
            "--batch-policy", "--kv-overflow", "--chat-template-cpu-s", "--restart-backoff-s", "--gateways")  # fmt: skip
COMMON = ("--model", "--port", "--host", "--api-key", "--served-model-name", "--max-model-len", "--max-loras",
          "--max-cpu-loras", "--max-lora-rank", "--lora-modules", "--workers", "--config", "--dtype", "--quantization")  # fmt: skip


def every_parser(parser: argparse.ArgumentParser, path: str = "loramesh"):
    """Every command's parser, hidden ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_parser(sub, f"{path} {name}")


def help_of(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def group_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {option: group.title for group in parser._action_groups for a in group._group_actions for option in a.option_strings}  # fmt: skip


def test_up_groups_common_and_advanced_flags(capsys):
    groups = group_of(subcommand(build_parser(), "up"))
    assert {groups[flag] for flag in COMMON} == {"common options"}
    assert {groups[flag] for flag in ADVANCED} == {"advanced options"}
    text = help_of("up", capsys=capsys)
    assert text.index("common options:") < text.index("  --lora-modules") < text.index("advanced options:")
    assert text.index("advanced options:") < text.index("  --lending-lane")


@pytest.mark.parametrize("command", ["up", "generate", "chat", "demo"])
def test_every_flag_states_its_default(command):
    parser = subcommand(build_parser(), command)
    silent = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction) and "default" not in (a.help or "")
    ]
    assert not silent, f"`loramesh {command} --help` gives no default for {', '.join(silent)}"


def test_the_batch_policy_states_the_actual_default(capsys):
    text = " ".join(help_of("up", capsys=capsys).split())
    assert f"[each gpu_worker; default {EngineConfig.batch_policy}]" in text
    assert (
        "default: the worker's" not in text
        and "default: the service's" not in text
        and "default ]" not in text
    )


def test_no_choice_is_empty_anywhere(capsys):
    for path, parser in every_parser(build_parser()):
        for action in parser._actions:
            if action.choices and not isinstance(action, argparse._SubParsersAction):
                assert all(str(c).strip() for c in action.choices), (
                    path,
                    action.option_strings,
                    action.choices,
                )
        text = parser.format_help()
        assert "{," not in text and ",}" not in text and ",," not in text, path


def test_sampling_flags_have_help(capsys):
    for command in ("generate", "chat"):
        text = " ".join(help_of(command, capsys=capsys).split())
        for flag in (
            "--max-tokens N",
            "--temperature T",
            "--top-p P",
            "--top-k K",
            "--seed N",
            "--stop TEXT",
        ):
            assert f"{flag} " in text, (command, flag)
        assert "0 decodes greedily" in text


def test_demo_is_a_command_and_the_development_ones_are_under_dev(capsys):
    top = help_of(capsys=capsys)
    listed = top[top.index("{") : top.index("}") + 1]
    assert "demo" in listed and "dev" in listed
    assert not {"bench", "bench-distkv", "bench-policies", "chaos"} & set(listed.strip("{}").split(","))
    assert subcommand(build_parser(), "demo").get_default("func") is demo.cmd_demo
    dev = help_of("dev", capsys=capsys)
    assert all(name in dev for name in ("bench", "bench-distkv", "bench-policies", "chaos"))
    parser = build_parser()
    for argv in (["dev", "bench"], ["bench"]):  # the old name still runs
        assert parser.parse_args(argv).func is bench_commands.cmd_bench
    for argv in (["dev", "chaos"], ["chaos"]):
        assert parser.parse_args(argv).func is chaos_commands.cmd_chaos
