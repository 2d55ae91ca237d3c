"""What a container's image is here: a root filesystem, its ENV, WORKDIR and entrypoint.

``loramesh`` images: the image itself when it has been built into buildah's local storage
(``make image``, tools/image/; vfs driver), mounted read-only as the pods' lower layer; otherwise
the host's root with the project's venv first on PATH and the Dockerfile's ENV and WORKDIR. The
etcd image: the host's ``etcd`` (Debian's etcd-server). Which one each image got is in the run's
log. Before 3.5.11 etcd has no ``/livez`` or ``/readyz``; with such an etcd the probes of those
paths ask ``/health``, and the log says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.cluster.pods.commands import CommandFailed, run

VENV = Path(sys.prefix)
"""The project's venv: the runner runs from it (``.venv/bin/python -m bench.cluster.pods``)."""
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOCKERFILE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "HOME": "/home/loramesh",
    "LANG": "C.UTF-8",
}
"""The Dockerfile's ENV (PATH aside)."""
ETCD_HEALTH_PATHS = (3, 5, 11)
"""The first etcd with /livez and /readyz."""
BUILDAH = ("buildah", "--storage-driver", "vfs")


@dataclass
class ImageRoot:
    """One image, as the run provides it."""

    image: str
    rootfs: Path
    """The containers' lower layer (read-only)."""
    env: dict[str, str]
    workdir: str
    entrypoint: list[str]
    description: str
    """What the run's log says about it."""
    host_root: bool = True
    """The host's own root: /root (mode 0700, where the venv's interpreter lives here) is made
    traversable in the pods' view of it, so that a pod's runAsUser can run that interpreter."""
    probe_paths: dict[str, str] = field(default_factory=dict)
    """HTTP probe paths asked as another path (an older etcd's /health for /livez)."""
    container_id: str = ""
    """buildah's working container, removed by :meth:`close`."""

    def close(self) -> None:
        if self.container_id:
            run(*BUILDAH, "umount", self.container_id, check=False)
            run(*BUILDAH, "rm", self.container_id, check=False)
            self.container_id = ""


def _vfs_top_layer(image_id: str) -> Path | None:
    """With buildah's vfs driver each layer is a whole root filesystem: the image's top layer's
    folder is the image, usable read-only as it is (a working container would copy it whole)."""
    try:
        graph_root = Path(json.loads(run(*BUILDAH, "info"))["store"]["GraphRoot"])
        images = json.loads((graph_root / "vfs-images" / "images.json").read_text())
    except (CommandFailed, OSError, KeyError, json.JSONDecodeError):
        return None
    layer = next((i.get("layer") for i in images if i.get("id") == image_id), None)
    folder = graph_root / "vfs" / "dir" / layer if layer else None
    return folder if folder is not None and folder.is_dir() else None


def _buildah_image(image: str) -> ImageRoot | None:
    """The image from buildah's storage; None when buildah or the image is not here."""
    for name in (image, f"localhost/{image}"):
        try:
            inspected = json.loads(run(*BUILDAH, "inspect", "--type", "image", name))
        except (CommandFailed, FileNotFoundError, json.JSONDecodeError):
            continue
        config = inspected.get("OCIv1", {}).get("config", {})
        env = dict(e.split("=", 1) for e in config.get("Env", []))
        image_id = inspected.get("FromImageID", "")
        rootfs, container = _vfs_top_layer(image_id), ""
        if rootfs is None:
            container = run(*BUILDAH, "from", "--pull=never", name).strip()
            rootfs = Path(run(*BUILDAH, "mount", container).strip())
        return ImageRoot(
            image, rootfs, env, config.get("WorkingDir") or "/", list(config.get("Entrypoint") or []),
            f"{image}: the image's root filesystem (buildah image {image_id[:12]}, {rootfs})",
            host_root=False, container_id=container,
        )  # fmt: skip
    return None


def _etcd_version() -> tuple[int, ...]:
    out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", out)
    if not found:
        raise RuntimeError(f"no etcd on this host answers --version (Debian: etcd-server): {out!r}")
    return tuple(int(g) for g in found.groups())


def resolve_image(image: str, use_built: bool = True) -> ImageRoot:
    """The :class:`ImageRoot` for an image the overlay names (``use_built=False``: the host's
    root even where the image is built, to run the working tree's code)."""
    repository = image.rsplit("/", 1)[-1].split(":", 1)[0]
    if repository == "loramesh":
        built = _buildah_image(image) if use_built else None
        if built is not None:
            return built
        return ImageRoot(
            image, Path("/"), {"PATH": f"{VENV}/bin:{HOST_PATH}", **DOCKERFILE_ENV}, "/opt/loramesh",
            ["python", "-m"], f"{image}: {'not built here' if use_built else 'not used'}; the host's root with the "
            f"project's venv ({VENV})",
        )  # fmt: skip
    if repository == "etcd":
        version = _etcd_version()
        rewrites = {} if version >= ETCD_HEALTH_PATHS else {"/livez": "/health", "/readyz": "/health"}
        note = (
            f"; etcd {'.'.join(map(str, version))} lacks /livez and /readyz: probed at /health"
            if rewrites
            else ""
        )
        return ImageRoot(image, Path("/"), {"PATH": HOST_PATH}, "/", ["etcd"],
                         f"{image}: the host's etcd{note}", probe_paths=rewrites)  # fmt: skip
    raise ValueError(f"image {image}: the run knows only the loramesh and etcd images")
