"""The import contracts of pyproject.toml hold, and they can fail: a copy of the tree with one
wrong-way import (a service importing the SDK, the worker's planner importing an executor, ...)
is refused, naming the broken contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("mesh_api", "loramesh", "loramesh_cli", "services", "bench")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, check=False, timeout=300
    )


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    """The packages and pyproject.toml, copied (only .py files matter to the linter)."""
    ignore = shutil.ignore_patterns("__pycache__", "results", "*.json", "*.png", "*.md")
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_repository_keeps_its_contracts():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("importer", "wrong_import", "contract"),
    [
        (
            "services/gateway/auth.py",
            "import loramesh.client",
            "Services never import the SDK, the CLI or bench",
        ),
        (
            "loramesh/types.py",
            "import services.runtime.errors",
            "The SDK stands alone: no services, CLI, bench or torch",
        ),
        (
            "services/runtime/errors.py",
            "import services.gateway.core",
            "Services are independent, on the model files, on the runtime",
        ),
        (
            "services/gateway/core.py",
            "import services.gpu_worker.config",
            "Services are independent, on the model files, on the runtime",
        ),
        (
            "services/gpu_worker/engine/engine.py",
            "import services.gpu_worker.executor.local",
            "The planner imports no executor, model, kernels or tensor-parallel code",
        ),
        (
            "services/gpu_worker/engine/admission.py",
            "import services.gpu_worker.model.llama",
            "The planner imports no executor, model, kernels or tensor-parallel code",
        ),
        (
            "services/gpu_worker/engine/adapter_pager.py",
            "import services.gpu_worker.kernels.dispatch",
            "The planner imports no executor, model, kernels or tensor-parallel code",
        ),
        (
            "services/gpu_worker/model/llama.py",
            "import services.gpu_worker.memory.unified_pool",
            "The model and attention do not import the worker's memory",
        ),
        (
            "services/gpu_worker/engine/kv_reservation.py",
            "import services.gpu_worker.distkv.rmanager",
            "DistKV is reached only through its interface",
        ),
        (
            "services/gpu_worker/memory/kv_cache.py",
            "import services.gpu_worker.distkv",
            "The worker's memory, model, attention and kernels do not know DistKV",
        ),
    ],
)
def test_a_wrong_way_import_breaks_its_contract(tree_copy, importer, wrong_import, contract):
    path = tree_copy / importer
    path.write_text(path.read_text() + f"\n{wrong_import}\n")
    done = lint_imports(tree_copy)
    assert done.returncode != 0, done.stdout
    report = " ".join(done.stdout.split())  # the report wraps long contract names
    assert f"{contract} BROKEN" in report, done.stdout
