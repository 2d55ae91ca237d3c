"""The committed stubs in mesh_api/v1 are exactly what the protos generate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("protos_generate", REPO_ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos(tmp_path):
    generated = _generator().generate(tmp_path)
    assert generated, "protoc generated nothing"
    committed_dir = REPO_ROOT / "mesh_api" / "v1"
    for path in generated:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is generated but not committed: run `make protos`"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale: run `make protos`"
    stale = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in generated}
    assert not stale, f"committed stubs with no proto: {sorted(stale)}"


def test_every_service_proto_declares_the_v1_package():
    for proto in (REPO_ROOT / "protos" / "loramesh" / "v1").glob("*.proto"):
        assert "package loramesh.v1;" in proto.read_text(), proto.name
