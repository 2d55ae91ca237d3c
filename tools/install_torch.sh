#!/usr/bin/env bash
# `make setup`'s first install: torch, pinned, in the build the variant names, before anything
# that depends on it. Left to the project's dependencies, pip on Linux takes PyPI's default torch,
# the CUDA build with several GB of NVIDIA libraries, even on a machine without a GPU.
#
#   tools/install_torch.sh PYTHON cpu  VERSION [INDEX_URL]   # torch==VERSION+cpu
#   tools/install_torch.sh PYTHON cuda VERSION [INDEX_URL]   # torch==VERSION, a CUDA build
#
# cpu: the pin names the local version (+cpu), which no PyPI torch matches, so a missing CPU wheel
# fails here rather than bringing CUDA. A wheel pip finds without any index (its find-links: a
# wheelhouse) is taken without asking INDEX_URL (download.pytorch.org/whl/cpu by the Makefile's
# default): where that host is unreachable but a PyPI mirror is not, pip would retry it for torch
# and each of its dependencies before going on (over a minute), then succeed anyway.
# cuda: from INDEX_URL (e.g. https://download.pytorch.org/whl/cu126, for one CUDA version) when
# given, else from pip's own index, whose Linux torch is built with CUDA. A CPU build already in
# the environment is removed first: pip would count it as torch==VERSION and keep it.
set -euo pipefail

if [ $# -lt 3 ] || [ $# -gt 4 ]; then
    echo "usage: $0 PYTHON cpu|cuda VERSION [INDEX_URL]" >&2
    exit 2
fi
python=$1 variant=$2 version=$3 index=${4:-}
pip() { "$python" -m pip install -q "$@"; }

case "$variant" in
cpu)
    if pip --no-index --no-deps "torch==$version+cpu" 2>/dev/null; then
        pip "torch==$version+cpu"  # its dependencies, from pip's own index
    else
        pip ${index:+--extra-index-url "$index"} "torch==$version+cpu"
    fi
    ;;
cuda)
    if "$python" -m pip show torch 2>/dev/null | grep -q '^Version: .*+cpu$'; then
        "$python" -m pip uninstall -q -y torch
    fi
    pip ${index:+--index-url "$index"} "torch==$version"
    ;;
*)
    echo "TORCH_VARIANT=$variant: cpu or cuda" >&2
    exit 2
    ;;
esac

# What pip chose, checked: a find-links wheelhouse holding VERSION+cpu also satisfies the cuda pin.
built=$("$python" -W ignore -c 'import torch; print("cuda" if torch.version.cuda else "cpu", torch.__version__)')
echo "torch: $built"
if [ "${built%% *}" != "$variant" ]; then
    echo "TORCH_VARIANT=$variant, but pip installed a ${built%% *} torch ($built): a wheel in pip's" \
        "find-links (PIP_FIND_LINKS, pip config list) matches the pin first; take it out of there" >&2
    exit 1
fi
