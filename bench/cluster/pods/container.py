"""One container as a process: in its pod's network namespace, its own mount and UTS
namespaces, a root filesystem of its own and the manifest's securityContext.

The root is an overlay: the image's filesystem (images.py) read-only below, a tmpfs above that
takes the mount points (and, without readOnlyRootFilesystem, the writes), then remounted
read-only when the manifest says so. Volumes are bind-mounted at their mountPath, the pod's hosts
file (``/etc/netns/<pod netns>/hosts``) over /etc/hosts, a resolv.conf that sends any name the
hosts file lacks to the pod's own loopback (nothing listens: the lookup fails at once, and no
query leaves), /dev (with a 64 MiB /dev/shm of its own), /proc and /sys from the host. Then
``chroot`` and ``setpriv``: runAsUser/runAsGroup, fsGroup and supplementalGroups as groups, no
capabilities when they are all dropped, no_new_privs unless privilege escalation is allowed.
seccomp profiles and resource limits are not applied.

The process is ``ip netns exec`` exec'ing ``unshare`` exec'ing ``sh`` exec'ing the command: its
pid is the container's, and its session holds whatever it starts.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.cluster.pods.images import HOST_PATH, VENV, ImageRoot
from bench.cluster.pods.volumes import Mount

RESOLV_CONF = "nameserver 127.0.0.1\nsearch {ns}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 attempts:1\n"


class ContainerConfigError(ValueError):
    """What the kubelet reports as CreateContainerConfigError."""


@dataclass(frozen=True)
class Identity:
    """Who the process runs as."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    no_new_privs: bool
    drop_all_capabilities: bool
    read_only_root: bool


def identity(pod_spec: Mapping, container: Mapping, image_user: tuple[int, int] = (0, 0)) -> Identity:
    """The securityContext of the pod and container merged (the container's wins)."""
    pod_ctx, ctx = pod_spec.get("securityContext") or {}, container.get("securityContext") or {}

    def setting(key: str, default):
        return ctx.get(key, pod_ctx.get(key, default))

    uid, gid = int(setting("runAsUser", image_user[0])), int(setting("runAsGroup", image_user[1]))
    if setting("runAsNonRoot", False) and uid == 0:
        raise ContainerConfigError(f"container {container['name']}: runAsNonRoot, but it would run as root")
    groups = [
        g for g in (pod_ctx.get("fsGroup"), *(pod_ctx.get("supplementalGroups") or [])) if g is not None
    ]
    return Identity(
        uid, gid, tuple(int(g) for g in groups),
        no_new_privs=not ctx.get("allowPrivilegeEscalation", True) or uid != 0,
        drop_all_capabilities="ALL" in ((ctx.get("capabilities") or {}).get("drop") or []),
        read_only_root=bool(ctx.get("readOnlyRootFilesystem", False)),
    )  # fmt: skip


def checkout_again(binds: list[Mount], root: str, checkout: Path = VENV.parent) -> list[str]:
    """Shell lines binding the project's checkout (its venv and code, which a host-root image
    runs) again where one of ``binds`` hides it: a checkout under /tmp (``mktemp -d``) is hidden
    by the pods' /tmp emptyDir. Its entries are bound one by one into a folder made there, so the
    checkout folder's own mode (0700 from ``mktemp``) does not stop a pod's runAsUser."""
    if not any(checkout.is_relative_to(mount.target) for mount in binds):
        return []
    q = shlex.quote
    target = root + q(str(checkout))
    lines = [f"mkdir -p {target}"]
    for entry in sorted(checkout.iterdir()):
        if entry.name == ".git":
            continue
        at = f"{target}/{q(entry.name)}"
        lines += [f"mkdir -p {at}" if entry.is_dir() else f"touch {at}",
                  f"mount --bind {q(str(entry))} {at}", f"mount -o remount,bind,ro {at}"]  # fmt: skip
    return lines


def resolve_in_root(root: Path, path: str) -> str:
    """``path`` as the container sees it, its symlinks followed inside ``root`` (an image's
    /var/run -> /run must not lead to the host's /run)."""
    parts, resolved, hops = [p for p in path.split("/") if p], [], 0
    while parts:
        part = parts.pop(0)
        if part in (".", ".."):
            resolved = resolved[:-1] if part == ".." else resolved
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise ContainerConfigError(f"{path}: too many symbolic links in the image")
            link = os.readlink(candidate)
            resolved = [] if link.startswith("/") else resolved
            parts = [p for p in link.split("/") if p] + parts
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


@dataclass
class ContainerLaunch:
    """Everything needed to start one container."""

    name: str
    """``<pod>/<container>``."""
    netns: str
    hostname: str
    namespace: str
    image: ImageRoot
    mounts: list[Mount]
    env: dict[str, str]
    argv: list[str]
    who: Identity
    workdir: str
    scratch: Path
    """An empty folder: the container's root is put together on it."""
    etc_dir: Path
    """``/etc/netns/<netns>``, holding the pod's hosts file."""

    def script(self) -> str:
        q = shlex.quote
        scratch = q(str(self.scratch))
        root = f"{scratch}/root"
        layers = f"lowerdir={q(str(self.image.rootfs))},upperdir={scratch}/upper,workdir={scratch}/work"
        lines = [
            "set -e",
            f"mount -t tmpfs -o mode=0755 lmpods {scratch}",
            f"mkdir {scratch}/upper {scratch}/work {root}",
            f"mount -t overlay overlay -o {layers} {root}",
        ]
        if self.image.host_root:
            lines.append(f"chmod 0711 {root}/root")
        binds = [Mount(self.etc_dir / "hosts", "/etc/hosts", True),
                 Mount(self.etc_dir / "resolv.conf", "/etc/resolv.conf", True), *self.mounts]  # fmt: skip
        for mount in binds:
            target = root + q(resolve_in_root(self.image.rootfs, mount.target))
            make = (
                f"mkdir -p {target}"
                if mount.source.is_dir()
                else f"mkdir -p $(dirname {target}); touch {target}"
            )
            lines += [make, f"mount --bind {q(str(mount.source))} {target}"]
            if mount.read_only:
                lines.append(f"mount -o remount,bind,ro {target}")
        if self.image.host_root:
            lines += checkout_again(binds, root)
        lines.append(f"mkdir -p {root}{q(resolve_in_root(self.image.rootfs, self.workdir))}")
        if self.who.read_only_root:
            lines.append(f"mount -o remount,ro {root}")
        lines += [
            f"mount --rbind /dev {root}/dev",
            f"mount -t tmpfs -o size=64m,mode=1777 shm {root}/dev/shm",
            f"mount --rbind /proc {root}/proc",
            f"mount --rbind /sys {root}/sys",
            f"hostname {q(self.hostname)}",
        ]
        setpriv = [f"--reuid={self.who.uid}", f"--regid={self.who.gid}"]
        setpriv.append(
            f"--groups={','.join(map(str, self.who.groups))}" if self.who.groups else "--clear-groups"
        )
        if self.who.no_new_privs:
            setpriv.append("--no-new-privs")
        if self.who.drop_all_capabilities:
            setpriv += ["--inh-caps=-all", "--bounding-set=-all"]
        lines.append(f'exec chroot {root} setpriv {" ".join(setpriv)} env -i -C {q(self.workdir)} -- "$@"')
        return "\n".join(lines)

    def files(self) -> None:
        """The pod's resolv.conf beside its hosts file."""
        (self.etc_dir / "resolv.conf").write_text(RESOLV_CONF.format(ns=self.namespace))

    def start(self, log: Path) -> subprocess.Popen:
        self.files()
        self.scratch.mkdir(parents=True, exist_ok=True)
        assignments = [f"{k}={v}" for k, v in self.env.items()]
        argv = ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", self.script(), "container", *assignments, *self.argv]  # fmt: skip
        with log.open("ab") as out:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={"PATH": HOST_PATH}, start_new_session=True,
            )  # fmt: skip


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the container's process and everything it started (its session: whatever it
    left behind too, once it has exited itself)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_now(proc: subprocess.Popen) -> None:
    signal_group(proc, signal.SIGKILL)
