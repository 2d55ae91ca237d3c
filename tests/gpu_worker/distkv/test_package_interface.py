"""The package's interface loads its names lazily: every exported name resolves, and each comes
from the submodule the lazy map names."""

from __future__ import annotations

import importlib

import pytest

from services.gpu_worker import distkv


def test_every_exported_name_resolves_from_its_submodule():
    assert set(distkv.__all__) == set(distkv._SUBMODULES)
    for name, submodule in distkv._SUBMODULES.items():
        module = importlib.import_module(f"services.gpu_worker.distkv.{submodule}")
        assert getattr(distkv, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchName"):
        distkv.NoSuchName  # noqa: B018
