"""The client SDK as its own distribution (``sdk/``, ``loramesh-client``): its wheel holds the SDK
modules and the generated stubs only, requires grpcio and protobuf only, and imports with torch
made unimportable and nothing of the repository on the path."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from support.sdk_wheel import ISOLATED, REPO, build_sdk_wheel, clean_env, sdk_venv

SDK_FILES = {
    f"loramesh/{name}.py"
    for name in (
        "__init__",
        "adapter_upload",
        "async_client",
        "client",
        "convert",
        "errors",
        "retry",
        "sampling_keywords",
        "stream_resume",
        "targets",
        "tls",
        "types",
    )
} | {"mesh_api/__init__.py", "mesh_api/adapter_transfer.py", "mesh_api/upload_wire.py", "mesh_api/version.py"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_sdk_wheel(tmp_path_factory.mktemp("sdk"))


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


def test_pip_installs_the_wheel_offline_into_a_clean_venv_with_its_requirements_only(wheel, tmp_path):
    """What tests/e2e/test_sdk_wheel.py runs against a mesh, without one: pip (the venv's own,
    --no-index) resolves the wheel's requirements against exactly grpcio, protobuf and what they
    need, and in that venv the SDK imports with nothing of the repository or torch importable."""
    python, linked = sdk_venv(tmp_path, wheel)
    # grpcio requires typing-extensions; nothing else comes along (no google.* but protobuf's).
    assert [n for n in linked if not n.endswith(".dist-info")] == [
        "google/_upb",
        "google/protobuf",
        "grpc",
        "typing_extensions.py",
    ]
    dists = sorted(n.split("-")[0] for n in linked if n.endswith(".dist-info"))
    assert dists == ["grpcio", "protobuf", "typing_extensions"]
    script = ISOLATED + "from loramesh import AsyncClient, Client\nprint('ok', Client.__module__)\n"
    done = subprocess.run(
        [str(python), "-I", "-c", script],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok loramesh.client"
