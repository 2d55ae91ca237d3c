"""The environment a service process is started with: an allow-list, not its parent's whole one.

``loramesh up`` runs with the operator's environment, which may hold the cloud credentials
(``AWS_*``, ``HF_TOKEN``, ...) meant for the adapter store's imports and blob tier, and the
client's own API key (``LORAMESH_API_KEY``). A child gets only what runs it: the interpreter's,
the system's and the numeric libraries' variables, the ``LORAMESH_*`` settings its service reads,
and, for the adapter store alone, the cloud's credentials and the network settings that reach
the cloud (proxies, CA bundles). Anything else is dropped: a variable no list names is not passed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from services.runtime.config import ENV_PREFIX

SYSTEM_VARIABLES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
     "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CC", "CXX", "MAX_JOBS"}
)  # fmt: skip
"""What any process needs to run Python here: where programs, home, locale, temporary files and
the virtual environment are; the dynamic linker's path (CUDA's libraries); the compiler and the
job count torch uses to build native code."""
SYSTEM_PREFIXES = (
    "LC_", "PYTHON", "XDG_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_",
    "MALLOC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH", "PYTORCH_", "TRITON_", "GRPC_",
    "TOKENIZERS_",
)  # fmt: skip
"""Families of variables that tune the interpreter, the C library's allocator, the threading and
math libraries, the accelerator, torch (and its distributed backends, for a tensor-parallel
group), Triton, gRPC and the tokenizers, none of which holds a secret."""
CLOUD_PREFIXES = ("AWS_", "HF_", "HUGGING_FACE_", "GOOGLE_", "CLOUDSDK_", "AZURE_")
"""The clouds' credentials and settings: S3 (and S3-compatible stores), the Hugging Face Hub,
Google Cloud, Azure. Only a service in :data:`CLOUD_SERVICES` gets them."""
CLOUD_VARIABLES = frozenset(
    {"http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
     "all_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}
)  # fmt: skip
"""How requests leave for the cloud (proxies, whose URLs may carry a password, and CA bundles):
with the credentials, since only the cloud's users go out; every other service talks to the
mesh on its own addresses."""
CLOUD_SERVICES = frozenset({"adapter_store"})
"""The services that reach a cloud: the adapter store imports ``s3://`` and ``hf://`` adapters
and may keep its blobs in a bucket. The workers and gateways fetch adapters from it."""


def child_environment(
    environ: Mapping[str, str], service: str, settings: Collection[str] | None = None
) -> dict[str, str]:
    """The variables of ``environ`` that ``service`` (``gpu_worker``, ``adapter_store``, ...) is
    started with. ``settings``: the ``LORAMESH_*`` variables it reads (its config's
    :func:`~services.runtime.config.setting_variables`, and any it reads beside them); None passes
    every ``LORAMESH_*`` variable."""
    cloud = service in CLOUD_SERVICES

    def passed(name: str) -> bool:
        if name.startswith(ENV_PREFIX):
            return settings is None or name in settings
        if name in SYSTEM_VARIABLES or name.startswith(SYSTEM_PREFIXES):
            return True
        return cloud and (name in CLOUD_VARIABLES or name.startswith(CLOUD_PREFIXES))

    return {name: value for name, value in environ.items() if passed(name)}
