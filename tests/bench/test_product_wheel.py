"""bench/ is a development-only distribution of its own (bench/pyproject.toml, ``loramesh-bench``):
the product wheel built from the root ships none of it, even with bench/ beside its packages, and
the bench wheel holds every subpackage of the folder and the simulator's calibrations, no results."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("loramesh", "mesh_api", "loramesh_cli", "services")
HANG_GUARD_S = 300
"""Not a timing claim: only turns a hung pip into a named failure."""
IGNORED = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
BENCH_IGNORED = shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "results", "out")


def build_wheel(project: Path, out: Path) -> Path:
    """The wheel of ``project``, built offline without build isolation (the venv's setuptools)."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(project)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The root's ``loramesh`` wheel, built from a copy of the tree that includes bench/ (an
    in-tree build would leave build/ and egg-info in the checkout others work in)."""
    tree = tmp_path_factory.mktemp("product-tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    for package in PRODUCT_PACKAGES:
        shutil.copytree(REPO / package, tree / package, ignore=IGNORED)
    shutil.copytree(REPO / "bench", tree / "bench", ignore=BENCH_IGNORED)
    return zipfile.ZipFile(build_wheel(tree, tmp_path_factory.mktemp("product-wheel")))


@pytest.fixture(scope="module")
def bench_wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The ``loramesh-bench`` wheel, built from a copy of bench/ without its results."""
    tree = tmp_path_factory.mktemp("bench-tree")
    shutil.copytree(REPO / "bench", tree / "bench", ignore=BENCH_IGNORED)
    return zipfile.ZipFile(build_wheel(tree / "bench", tmp_path_factory.mktemp("bench-wheel")))


def test_the_product_wheel_ships_its_packages_and_no_bench(product_wheel):
    names = product_wheel.namelist()
    assert not [n for n in names if n.startswith("bench/")]
    assert all(f"{package}/__init__.py" in names for package in PRODUCT_PACKAGES)
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    extras = Parser().parsestr(product_wheel.read(metadata).decode()).get_all("Provides-Extra") or []
    assert "bench" not in extras


def test_the_bench_wheel_maps_every_subpackage_of_the_folder(bench_wheel):
    names = bench_wheel.namelist()
    packages = {str(Path(n).parent) for n in names if n.endswith("/__init__.py")}
    in_checkout = {str(p.parent.relative_to(REPO)) for p in (REPO / "bench").rglob("__init__.py")}
    assert packages == in_checkout
    assert "bench/cluster_sim/calibrations/grid_busy.json" in names
    assert not [n for n in names if n.startswith(("bench/results/", "bench/out/"))]
