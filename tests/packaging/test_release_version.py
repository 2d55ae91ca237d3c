"""One release, written once (``mesh_api/version.py``): what ``loramesh --version`` prints, what
the changelog's newest entry and the Kubernetes overlays' image tags name, under the Apache-2.0
license the distributions declare."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import loramesh
from loramesh_cli.main import main
from mesh_api.version import VERSION

REPO = Path(__file__).resolve().parents[2]


def test_the_version_is_pep_440_and_the_sdk_reports_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", VERSION)
    assert loramesh.__version__ == VERSION


def test_loramesh_version_prints_it(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"loramesh {VERSION}\n"


def test_the_changelogs_newest_entry_is_this_release():
    headings = re.findall(r"^## \[([^\]]+)\]", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    released = [h for h in headings if h != "Unreleased"]
    assert released and released[0] == VERSION, headings


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_overlays_run_the_image_of_this_release(overlay):
    kustomization = yaml.safe_load((REPO / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text())
    (image,) = [i for i in kustomization["images"] if i["name"] == "loramesh"]
    assert image["newTag"] == f"{VERSION}-{'cpu' if overlay == 'cpu' else 'cuda'}"


def test_the_license_is_apache_2():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
