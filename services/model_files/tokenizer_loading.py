"""The base model's tokenizer and the few model facts text handling needs, without any weight.

The gateway tokenizes, renders chat templates, detokenizes and checks prompts against the
vocabulary and the context length; none of that needs the weights (about 140 GB for a 70B base).

- A HF directory: ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
  ``config.json`` and ``generation_config.json`` are read; no ``*.safetensors`` file is opened.
- A GGUF file keeps its tokenizer in the header: only metadata is parsed (the reader maps the
  file into memory and never touches tensor data). Parsing 49k vocabulary strings takes
  seconds, so the result is cached as JSON beside the converted weights, keyed like them by
  the file's size and modification time.

No torch here, and nothing that imports it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model_files.base_model import default_model_path
from services.model_files.cache_dir import default_cache_dir
from services.model_files.model_config import read_hf_config
from services.model_files.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when what is cached changes, so files written by older code are not trusted.
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class TokenizerBundle:
    """A tokenizer with the facts about its model that checking and rendering text need."""

    tokenizer: Tokenizer
    """Text <-> ids, chat template, end-of-generation ids (config's and generation config's too)."""
    model_name: str
    """The base model's tag, as the workers and the adapter store name it."""
    context_length: int
    """Longest sequence (prompt + output) the model was trained for."""
    source: str
    """What was read: the HF directory, the GGUF file, or the cached tokenizer JSON."""


def load_tokenizer(path: str | Path | None = None, cache_dir: str | Path | None = None) -> TokenizerBundle:
    """The tokenizer of the HF directory or GGUF file at ``path`` (``None``: the default SmolLM2).

    ``cache_dir`` holds the cached GGUF tokenizers (default
    :func:`~services.model_files.cache_dir.default_cache_dir`).
    """
    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        config = read_hf_config(path)
        tokenizer = Tokenizer.from_hf_dir(path, extra_eos_token_ids=config.eos_token_ids)
        return TokenizerBundle(tokenizer, config.name, config.max_position_embeddings, str(path))
    if not path.is_file():
        raise FileNotFoundError(f"no model at {path}")
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a .gguf file nor a HF model directory")
    cached = _cache_path(path, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    hit = _read_cached(cached)
    if hit is not None:
        return hit
    bundle = _from_gguf_header(path)
    _write_cached(cached, bundle)
    return bundle


def _from_gguf_header(path: Path) -> TokenizerBundle:
    from gguf import GGUFReader  # numpy only; imported here because only a cache miss needs it

    reader = GGUFReader(str(path))

    def value(key: str, default: Any = None) -> Any:
        field = reader.get_field(key)
        return default if field is None else field.contents()

    arch = value("general.architecture", "llama")
    # The file stem without its quantization suffix, as ModelConfig.from_gguf and the store name it.
    name = path.name.split(".")[0]
    return TokenizerBundle(
        Tokenizer.from_gguf(reader), name, int(value(f"{arch}.context_length", 2048)), str(path)
    )


def _cache_path(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    return cache_dir / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}.tokenizer.json"


def _read_cached(path: Path) -> TokenizerBundle | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != _CACHE_FORMAT:
            return None
        return TokenizerBundle(
            Tokenizer.from_json(data["tokenizer"]), data["model_name"], int(data["context_length"]), str(path)
        )
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception; a bad cache costs a re-parse
        log.warning("ignoring unusable tokenizer cache %s: %s", path, exc)
        return None


def _write_cached(path: Path, bundle: TokenizerBundle) -> None:
    """Temp file, then rename: a reader never sees half a file. A failure only costs a re-parse."""
    text = json.dumps(
        {
            "format": _CACHE_FORMAT,
            "tokenizer": bundle.tokenizer.to_json(),
            "model_name": bundle.model_name,
            "context_length": bundle.context_length,
        }
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(text)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not write tokenizer cache %s: %s", path, exc)
