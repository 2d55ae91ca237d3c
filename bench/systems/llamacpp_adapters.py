"""The benchmark's PEFT adapters as GGUF LoRA files for llama-server, converted once.

llama.cpp's own ``convert_lora_to_gguf.py`` does the conversion (it permutes q/k as llama.cpp
lays them out, so only it knows the right layout), run with the llama.cpp checkout's ``gguf-py``
ahead of any installed ``gguf``. It needs the base model's Hugging Face ``config.json``: a GGUF
base has none, so one is written from the model's dimensions (all the converter reads for a
Llama LoRA). Results are cached beside the adapter set (``<root>-gguf/``), one file per adapter
named by a hash of what determines it (the adapter's files, the base config, the converter), so
a rewritten adapter or another llama.cpp is converted again and nothing stale is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.systems.base import AdapterSet
from services.model_files.base_model import BaseModelSpec

CONVERTER = "convert_lora_to_gguf.py"
OUTTYPE = "f16"
"""The bench adapters are float16: converted without loss."""
CONVERT_TIMEOUT_S = 3600
LOG_TAIL_LINES = 20

# One interpreter converts every adapter (importing torch and transformers once, not per adapter):
# the script is run as __main__ again for each (input, output) pair of argv.
_CONVERT_MANY = """
import runpy, sys
script, base, outtype, pairs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
for source, target in zip(pairs[::2], pairs[1::2]):
    sys.argv = [script, "--base", base, "--outfile", target, "--outtype", outtype, source]
    runpy.run_path(script, run_name="__main__")
"""


class ConversionError(RuntimeError):
    """The converter is missing or failed."""


def find_converter(llama_server: Path) -> Path:
    """``convert_lora_to_gguf.py`` of the llama.cpp checkout ``llama_server`` was built in
    (``<checkout>/build/bin/llama-server``): the nearest directory above the binary holding it."""
    for directory in Path(llama_server).resolve().parents:
        if (directory / CONVERTER).is_file():
            return directory / CONVERTER
    raise ConversionError(
        f"no {CONVERTER} in any directory above {llama_server}: use a llama-server built inside its "
        "llama.cpp checkout (docs/benchmarks.md)"
    )


def converter_base_config(spec: BaseModelSpec) -> dict:
    """The Hugging Face ``config.json`` of a Llama base with ``spec``'s dimensions."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
    }


def gguf_adapters(adapters: AdapterSet, spec: BaseModelSpec, converter: Path) -> list[Path]:
    """One GGUF LoRA file per adapter of ``adapters``, in index order; converts those not cached."""
    directories = [adapters.directory(i) for i in range(adapters.count)]
    return gguf_lora_files(directories, spec, converter, adapters.root.parent / f"{adapters.root.name}-gguf")


def gguf_lora_files(
    directories: list[Path], spec: BaseModelSpec, converter: Path, cache: Path | None = None
) -> list[Path]:
    """One GGUF LoRA file per PEFT adapter directory, in order, kept in ``cache`` (default: a
    ``-gguf`` folder beside the first directory's parent); converts those not cached."""
    if cache is None:
        cache = directories[0].parent.parent / f"{directories[0].parent.name}-gguf"
    config = json.dumps(converter_base_config(spec), sort_keys=True)
    context = hashlib.sha256(config.encode() + Path(converter).read_bytes()).digest()
    cache.mkdir(parents=True, exist_ok=True)
    targets = [cache / f"{_content_key(directory, context)}.gguf" for directory in directories]
    missing = [(directory, t) for directory, t in zip(directories, targets) if not t.exists()]
    if missing:
        _convert(missing, config, Path(converter), cache)
    return targets


def _content_key(directory: Path, context: bytes) -> str:
    digest = hashlib.sha256(context)
    for path in sorted(directory.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def _convert(pairs: list[tuple[Path, Path]], config: str, converter: Path, cache: Path) -> None:
    checkout = converter.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(checkout / "gguf-py"), str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])]
    )}  # fmt: skip
    # The scratch folder is inside the cache so that the finished files are renamed, not copied.
    with tempfile.TemporaryDirectory(prefix=".converting-", dir=cache) as scratch:
        base = Path(scratch) / "base"
        base.mkdir()
        (base / "config.json").write_text(config)
        # Written in scratch and renamed once complete: an interrupted conversion leaves no
        # file that looks cached.
        partial = [(source, Path(scratch) / f"{i}.gguf") for i, (source, _) in enumerate(pairs)]
        argv = [str(converter), str(base), OUTTYPE, *(str(p) for pair in partial for p in pair)]
        done = subprocess.run(
            [sys.executable, "-c", _CONVERT_MANY, *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=CONVERT_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-LOG_TAIL_LINES:])
            raise ConversionError(f"{converter.name} failed (exit {done.returncode}):\n{tail}")
        for (_, written), (_, target) in zip(partial, pairs):
            os.replace(written, target)
