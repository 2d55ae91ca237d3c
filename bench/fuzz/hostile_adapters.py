"""Adapters built to hurt whoever reads them: the files an upload sends, and directories a path
load reads.

Each is one valid PEFT adapter (its config and safetensors) with one thing wrong:

- **templates**: a chat template that loops for ever, nests loops, renders gigabytes, recurses,
  reaches for Python attributes (``__class__``, ``__globals__``) or does not parse; a
  ``tokenizer_config.json`` that is no object, or whose template is not a string;
- **configs**: fields of the wrong type, ranks past any model, missing fields, NaN, deep JSON;
- **safetensors headers**: a header length of 2^63 or past the file, a header that is not JSON,
  offsets past the data or overlapping, a dtype whose size the bytes do not match, shapes
  negative or overflowing;
- **file trees** (path load only): a file that is a symlink out of the tree, a symlink loop, a
  FIFO (whose reader blocks until a writer comes), a directory where a file belongs, 100 levels
  of nested directories, a sparse file of 4 GiB.

Every one must be refused with a clear status (or, for a template, accepted and then refused when
a chat is laid out with it), and none may hold an event loop.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

TEMPLATES = {
    "template: endless loop": "{% for i in range(10**12) %}x{% endfor %}",
    "template: nested loops": "{% for a in range(10**5) %}{% for b in range(10**5) %}{% endfor %}{% endfor %}",
    "template: huge output": "{{ 'a' * 10**10 }}",
    "template: doubling": "{% set s = namespace(v='ab') %}{% for i in range(64) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}",
    "template: recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "template: class walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "template: globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "template: messages attributes": "{{ messages.__class__.__init__.__globals__ }}",
    "template: syntax error": "{% for %}",
    "template: raises": "{{ raise_exception('no') }}",
    "template: undefined call": "{{ nothing() }}",
}  # fmt: skip
"""Chat templates (``chat_template.jinja``) by label."""


def _with_config(valid: dict[str, bytes], change: Callable[[dict], object]) -> dict[str, bytes]:
    config = json.loads(valid[CONFIG])
    changed = change(config)
    if isinstance(changed, bytes):
        return {**valid, CONFIG: changed}
    config = config if changed is None else changed
    return {**valid, CONFIG: json.dumps(config, allow_nan=True).encode()}


def _set(key: str, value) -> Callable[[dict], None]:
    return lambda config: config.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict], None]:
    def drop(config: dict) -> None:
        config.pop(key, None)

    return drop


CONFIG_CHANGES: dict[str, Callable[[dict], object]] = {
    "config: r a string": _set("r", "8"),
    "config: r huge": _set("r", 2**40),
    "config: r negative": _set("r", -8),
    "config: r zero": _set("r", 0),
    "config: alpha NaN": _set("lora_alpha", float("nan")),
    "config: targets a number": _set("target_modules", 5),
    "config: targets unknown": _set("target_modules", ["lm_head", "embed_tokens"]),
    "config: no targets": _drop("target_modules"),
    "config: no peft_type": _drop("peft_type"),
    "config: no r": _drop("r"),
    "config: rank_pattern huge": _set("rank_pattern", {f"layers.{i}.": 2**31 for i in range(1000)}),
    "config: layers negative": _set("layers_to_transform", [-1, 2**40]),
    "config: a list": lambda config: [config],
    "config: deep": lambda config: b"[" * 100_000 + b"]" * 100_000,
    "config: not JSON": lambda config: b'{"r": ',
}
"""Changes to ``adapter_config.json`` by label."""


def _split(weights: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", weights[:8])
    return json.loads(weights[8 : 8 + length]), weights[8 + length :]


def _join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _tensors(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _with_header(change: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    def apply(weights: bytes) -> bytes:
        header, data = _split(weights)
        change(header)
        return _join(header, data)

    return apply


def _first(change: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda header: change(header[_tensors(header)[0]])


def _overlap(header: dict) -> None:
    first, second = (header[name] for name in _tensors(header)[:2])
    second["data_offsets"] = list(first["data_offsets"])


WEIGHT_CHANGES: dict[str, Callable[[bytes], bytes]] = {
    "safetensors: header length 2^63": lambda w: struct.pack("<Q", 2**63) + w[8:],
    "safetensors: header length past the file": lambda w: struct.pack("<Q", len(w)) + w[8:],
    "safetensors: header not JSON": lambda w: struct.pack("<Q", 5) + b"{{{{{" + w[8:],
    "safetensors: header a list": lambda w: _join([], _split(w)[1]),  # type: ignore[arg-type]
    "safetensors: truncated": lambda w: w[: len(w) // 2],
    "safetensors: only the length": lambda w: w[:8],
    "safetensors: empty": lambda w: b"",
    "safetensors: offsets past the data": _with_header(_first(lambda t: t.__setitem__("data_offsets", [0, 2**62]))),
    "safetensors: offsets reversed": _with_header(_first(lambda t: t.__setitem__("data_offsets", t["data_offsets"][::-1]))),
    "safetensors: overlapping tensors": _with_header(_overlap),
    "safetensors: dtype lie": _with_header(_first(lambda t: t.__setitem__("dtype", "F64"))),
    "safetensors: unknown dtype": _with_header(_first(lambda t: t.__setitem__("dtype", "Q4_K"))),
    "safetensors: negative shape": _with_header(_first(lambda t: t.__setitem__("shape", [-1, 8]))),
    "safetensors: shape overflow": _with_header(_first(lambda t: t.__setitem__("shape", [2**62, 2**62]))),
    "safetensors: metadata not strings": _with_header(lambda h: h.__setitem__("__metadata__", {"a": [1] * 10_000})),
    "safetensors: NaN weights": lambda w: w[: len(w) - 4] + struct.pack("<f", float("nan")),
}  # fmt: skip
"""Changes to ``adapter_model.safetensors`` by label."""


def uploads(valid: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    """Every hostile adapter an upload can send, by label: ``valid`` (config and weights) with one
    thing wrong."""
    out: dict[str, dict[str, bytes]] = {}
    for label, template in TEMPLATES.items():
        out[label] = {**valid, "chat_template.jinja": template.encode()}
    out["template: tokenizer_config a list"] = {**valid, "tokenizer_config.json": b"[1, 2]"}
    out["template: tokenizer_config template a number"] = {
        **valid,
        "tokenizer_config.json": json.dumps({"chat_template": 5}).encode(),
    }
    out["template: tokenizer_config templates a map"] = {
        **valid,
        "tokenizer_config.json": json.dumps({"chat_template": [{"name": "x", "template": TEMPLATES["template: endless loop"]}]}).encode(),
    }  # fmt: skip
    for label, change in CONFIG_CHANGES.items():
        out[label] = _with_config(valid, change)
    for label, change in WEIGHT_CHANGES.items():
        out[label] = {**valid, WEIGHTS: change(valid[WEIGHTS])}
    return out


def _write(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def trees(root: Path, valid: dict[str, bytes]) -> dict[str, Path]:
    """Hostile adapter directories written under ``root``, by label: each upload of
    :func:`uploads` as a directory, and the trees only a path can hold."""
    out: dict[str, Path] = {}
    for i, (label, files) in enumerate(uploads(valid).items()):
        _write(root / f"upload-{i}", files)
        out[label] = root / f"upload-{i}"

    def tree(label: str, make: Callable[[Path], None]) -> None:
        path = root / f"tree-{len(out)}"
        path.mkdir(parents=True)
        make(path)
        out[label] = path

    def escaping(path: Path) -> None:
        (path / CONFIG).write_bytes(valid[CONFIG])
        (path / WEIGHTS).symlink_to("/etc/passwd")

    def looping(path: Path) -> None:
        (path / CONFIG).symlink_to(path / "loop")
        (path / "loop").symlink_to(path / CONFIG)
        (path / WEIGHTS).write_bytes(valid[WEIGHTS])

    def fifo(path: Path) -> None:
        os.mkfifo(path / CONFIG)
        (path / WEIGHTS).write_bytes(valid[WEIGHTS])

    def fifo_weights(path: Path) -> None:
        (path / CONFIG).write_bytes(valid[CONFIG])
        os.mkfifo(path / WEIGHTS)

    def directory_for_file(path: Path) -> None:
        (path / CONFIG).mkdir()
        (path / WEIGHTS).write_bytes(valid[WEIGHTS])

    def nested(path: Path) -> None:
        _write(path, valid)
        _write(path.joinpath(*(["d"] * 100)), valid)

    def sparse(path: Path) -> None:
        (path / CONFIG).write_bytes(valid[CONFIG])
        with open(path / WEIGHTS, "wb") as f:
            f.truncate(4 * 2**30)

    def device(path: Path) -> None:
        (path / CONFIG).write_bytes(valid[CONFIG])
        (path / WEIGHTS).symlink_to("/dev/zero")

    tree("tree: symlink out of the tree", escaping)
    tree("tree: symlink loop", looping)
    tree("tree: FIFO config", fifo)
    tree("tree: FIFO weights", fifo_weights)
    tree("tree: directory for a file", directory_for_file)
    tree("tree: 100 nested directories", nested)
    tree("tree: sparse 4 GiB weights", sparse)
    tree("tree: weights are /dev/zero", device)
    tree("tree: empty", lambda path: None)
    return out
