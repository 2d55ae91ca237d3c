"""The bench commands on a product install, where ``bench`` is not importable: a refusal that says
how to get the benchmarks, before anything runs."""

from __future__ import annotations

import sys

import pytest

from loramesh_cli.main import main


@pytest.fixture
def without_bench(monkeypatch):
    for name in [n for n in sys.modules if n == "bench" or n.startswith("bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "bench", None)  # any import of bench now raises ImportError


@pytest.mark.parametrize("command", [["bench"], ["bench-distkv"], ["bench-policies", "--only", "pets"]])
def test_a_bench_command_without_bench_says_how_to_install_it(without_bench, command, tmp_path, capsys):
    assert main([*command, "--out", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "the benchmarks are not installed" in error
    assert "make setup" in error and "pip install -e ./bench" in error
    assert not (tmp_path / "out").exists()
