"""Where a ``lora_path`` (vLLM's ``/v1/load_lora_adapter``) leads: under ``--adapter-load-dirs``
only, a relative one looked up under each of them in order and never against the working
directory, and nothing outside them however it is spelled."""

from __future__ import annotations

import os

import pytest

from services.gateway.adapter_load_dirs import load_roots, resolve_adapter_dir
from services.runtime.errors import InvalidArgument, PermissionDenied


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """``first/{a}``, ``second/{a,b}``, ``outside/c``, and a link ``first/out`` -> ``outside``;
    the working directory is ``outside``, which has ``b`` too."""
    for d in ("first/a", "second/a", "second/b", "outside/b", "outside/c"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "first" / "out").symlink_to(tmp_path / "outside")
    monkeypatch.chdir(tmp_path / "outside")
    return tmp_path


def roots(tree, *names: str):
    return load_roots(", ".join(str(tree / n) for n in names))


def test_a_relative_path_is_looked_up_under_each_load_dir_in_order(tree):
    assert resolve_adapter_dir("a", roots(tree, "first", "second")) == tree / "first" / "a"
    assert resolve_adapter_dir("a", roots(tree, "second", "first")) == tree / "second" / "a"
    assert resolve_adapter_dir("b", roots(tree, "first", "second")) == tree / "second" / "b"
    assert resolve_adapter_dir("./a/", roots(tree, "second")) == tree / "second" / "a"


def test_a_relative_path_never_resolves_against_the_working_directory(tree):
    assert os.path.isdir("c")  # it is there, in the working directory
    with pytest.raises(InvalidArgument, match=r"'c' does not exist under .*first"):
        resolve_adapter_dir("c", roots(tree, "first"))


def test_an_absolute_path_under_a_load_dir_is_taken_as_it_is(tree):
    assert (
        resolve_adapter_dir(str(tree / "second" / "b"), roots(tree, "first", "second"))
        == tree / "second" / "b"
    )
    with pytest.raises(InvalidArgument, match="does not exist"):
        resolve_adapter_dir(str(tree / "second" / "z"), roots(tree, "second"))


@pytest.mark.parametrize(
    "path", ["../outside/c", "..", "a/../../outside/c", "out/c", "/etc", "{tree}/outside/c"]
)
def test_a_path_leading_out_of_the_load_dirs_is_refused(tree, path):
    with pytest.raises(PermissionDenied, match="not under a directory the gateway may load adapters from"):
        resolve_adapter_dir(path.format(tree=tree), roots(tree, "first"))


def test_a_path_that_leaves_one_load_dir_for_another_stays_allowed(tree):
    assert resolve_adapter_dir("../second/b", roots(tree, "first", "second")) == tree / "second" / "b"


def test_loading_by_path_is_off_without_load_dirs(tree):
    with pytest.raises(PermissionDenied, match="--adapter-load-dirs"):
        resolve_adapter_dir("a", load_roots(" , "))
