"""A pod's volumes as directories under the run's folder, and its containers' mounts of them.

Secret and ConfigMap volumes are written file by file (items, defaultMode, optional), owned by
the pod's fsGroup as the kubelet makes them; emptyDir is an empty world-writable folder; a
PersistentVolumeClaim (a StatefulSet's per-pod claim too) is a folder per claim, shared by every
pod that mounts it; cert-manager's csi-driver volume holds the pod's own certificate
(mesh_secrets.pod_certificate); every container gets the service-account token folder at
``/var/run/secrets/kubernetes.io/serviceaccount`` unless the pod opts out. The containers see
them at their mountPath through bind mounts in their own mount namespace (container.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.cluster.pods.placement import PodPlan

SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_MODE = 0o644


class MissingObject(ValueError):
    """A volume or env source names a ConfigMap or Secret the run does not have."""


@dataclass(frozen=True)
class Mount:
    """One bind mount into a container."""

    source: Path
    target: str
    read_only: bool


@dataclass
class VolumeSources:
    """Where a pod's volumes come from."""

    config_maps: Mapping[str, Mapping[str, str]]
    secrets: Mapping[str, Mapping[str, bytes]]
    claims: Path
    """Folder holding one folder per PersistentVolumeClaim."""
    csi: Callable[[PodPlan, dict], dict[str, bytes]]
    """A csi volume's files for a pod, from its volumeAttributes."""
    service_account: Callable[[PodPlan], dict[str, bytes]]
    """The token, ca.crt and namespace files of a pod's service account."""


def _write_files(directory: Path, files: Mapping[str, bytes], mode: int, group: int | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, mode)
        if group is not None:
            os.chown(path, 0, group)
    if group is not None:
        os.chown(directory, 0, group)
    os.chmod(directory, 0o755)


def _folder(path: Path, mode: int, group: int | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if group is not None:
        os.chown(path, 0, group)
    return path


def _projected(source: Mapping, data: Mapping[str, bytes]) -> dict[str, bytes]:
    """``items`` (key -> path) or every key."""
    if not source.get("items"):
        return dict(data)
    out = {}
    for item in source["items"]:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise MissingObject(f"key {item['key']} is not in the object the volume names")
        out[item["path"]] = data[item["key"]]
    return out


SERVICE_ACCOUNT_VOLUME = "(service account)"


@dataclass
class PodVolumes:
    """A pod's volumes, made."""

    folders: dict[str, Path]
    """Volume name -> its folder."""
    read_only: set[str]
    """Volumes the kubelet always mounts read-only (Secret, ConfigMap, csi, the token)."""


def prepare_volumes(pod: PodPlan, pod_dir: Path, sources: VolumeSources) -> PodVolumes:
    """Every volume of ``pod``, made."""
    group = (pod.spec.get("securityContext") or {}).get("fsGroup")
    folders: dict[str, Path] = {}
    read_only: set[str] = set()
    for volume in pod.spec.get("volumes", []):
        name, target = volume["name"], pod_dir / "volumes" / volume["name"]
        if "secret" in volume or "configMap" in volume:
            source = volume.get("secret") or volume["configMap"]
            object_name = source.get("secretName") or source.get("name")
            table = sources.secrets if "secret" in volume else sources.config_maps
            raw = table.get(object_name)
            if raw is None and not source.get("optional"):
                what = "Secret" if "secret" in volume else "ConfigMap"
                raise MissingObject(
                    f"pod {pod.name}: volume {name} names {what} {object_name}, which the run lacks"
                )
            data = {k: v if isinstance(v, bytes) else v.encode() for k, v in (raw or {}).items()}
            _write_files(
                target, _projected(source, data), int(source.get("defaultMode", DEFAULT_MODE)), group
            )
            read_only.add(name)
        elif "emptyDir" in volume:
            _folder(target, 0o777, group)
        elif "persistentVolumeClaim" in volume:
            target = _folder(sources.claims / volume["persistentVolumeClaim"]["claimName"], 0o2775, group)
        elif "csi" in volume:
            csi = volume["csi"]
            attributes = {k: str(v) for k, v in (csi.get("volumeAttributes") or {}).items()}
            fs_group = attributes.get("csi.cert-manager.io/fs-group")
            _write_files(target, sources.csi(pod, attributes), 0o440, int(fs_group) if fs_group else group)
            read_only.add(name)
        else:
            raise MissingObject(
                f"pod {pod.name}: volume {name} is of a type the run does not make: {sorted(volume)}"
            )
        folders[name] = target
    for template, claim in pod.claims.items():
        folders[template] = _folder(sources.claims / claim, 0o2775, group)
    if pod.spec.get("automountServiceAccountToken", True):
        folders[SERVICE_ACCOUNT_VOLUME] = pod_dir / "serviceaccount"
        _write_files(folders[SERVICE_ACCOUNT_VOLUME], sources.service_account(pod), 0o644, None)
        read_only.add(SERVICE_ACCOUNT_VOLUME)
    return PodVolumes(folders, read_only)


def container_mounts(container: Mapping, volumes: PodVolumes) -> list[Mount]:
    """The container's volumeMounts (subPath included), then the service-account folder."""
    mounts = []
    for mount in container.get("volumeMounts", []):
        name = mount["name"]
        if name not in volumes.folders:
            raise MissingObject(f"container {container['name']} mounts volume {name}, which the pod lacks")
        source = volumes.folders[name] / mount.get("subPath", "")
        mounts.append(
            Mount(source, mount["mountPath"], bool(mount.get("readOnly")) or name in volumes.read_only)
        )
    token = volumes.folders.get(SERVICE_ACCOUNT_VOLUME)
    if token is not None and not any(m.target == SERVICE_ACCOUNT_MOUNT for m in mounts):
        mounts.append(Mount(token, SERVICE_ACCOUNT_MOUNT, True))
    return mounts
