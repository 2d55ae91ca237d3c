"""The client SDK as its own distribution (``sdk/``, ``loramesh-client``): its wheel holds the SDK
modules and the generated stubs only, requires grpcio and protobuf only, and imports with torch
made unimportable and nothing of the repository on the path."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SDK_FILES = {
    f"loramesh/{name}.py"
    for name in ("__init__", "client", "async_client", "errors", "stream_resume", "tls", "types")
} | {"mesh_api/__init__.py", "mesh_api/adapter_transfer.py"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built offline from a copy of ``sdk/`` and ``loramesh/`` and ``mesh_api/`` (an in-tree build would
    leave build/ and egg-info in the checkout others work in)."""
    tree = tmp_path_factory.mktemp("sdk-tree")
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    shutil.copytree(REPO / "sdk", tree / "sdk", ignore=ignore)
    shutil.copytree(REPO / "loramesh", tree / "loramesh", ignore=ignore)
    shutil.copytree(REPO / "mesh_api", tree / "mesh_api", ignore=ignore)
    out = tmp_path_factory.mktemp("sdk-wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(tree / "sdk")],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = out.glob("loramesh_client-*.whl")
    return found


def test_the_wheel_holds_the_sdk_and_the_stubs_only(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    code = {n for n in names if not n.startswith("loramesh_client-")}
    stubs = {
        f"mesh_api/v1/{p.name}" for p in (REPO / "mesh_api" / "v1").iterdir() if p.suffix in (".py", ".pyi")
    }
    assert code == SDK_FILES | stubs
    assert not any(n.startswith(("services/", "bench/", "loramesh_cli/", "loramesh/demo")) for n in names)


def test_the_wheel_requires_grpcio_and_protobuf_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    assert metadata["Name"] == "loramesh-client"
    requirements = metadata.get_all("Requires-Dist")
    assert sorted(r.split(">")[0] for r in requirements) == ["grpcio", "protobuf"]
    assert not any("torch" in r for r in requirements)


IMPORT_WITHOUT_TORCH = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
sys.modules["torch"] = None  # any import of torch now raises ImportError
from loramesh import AsyncClient, Client, LoraMeshError, TextDelta
import loramesh.stream_resume
assert loramesh.__file__.startswith(sys.argv[1]), loramesh.__file__
with Client("127.0.0.1:1", api_key="sk-test") as client:
    assert client.failovers == 0
for absent in ("loramesh_cli", "services"):
    try:
        __import__(absent)
    except ImportError:
        pass
    else:
        raise AssertionError(absent + " is importable")
print("ok", AsyncClient.__module__)
"""


def test_the_sdk_imports_without_torch_or_the_repository(wheel, tmp_path):
    installed = tmp_path / "installed"
    zipfile.ZipFile(wheel).extractall(installed)
    # -I -S: no current directory, no PYTHON* variables and no site-packages processing (so not
    # the editable install of the whole repository); only the wheel and grpcio/protobuf's dir.
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", IMPORT_WITHOUT_TORCH, str(installed), sysconfig.get_paths()["purelib"]],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok loramesh.async_client"
