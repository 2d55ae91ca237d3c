"""A PEFT adapter directory as ``UploadAdapter`` messages: checked on the caller's machine first,
so a wrong directory is named before anything is sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mesh_api.adapter_transfer import read_adapter_dir
from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import types_pb2

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
"""PEFT's older weights format, a pickle: the store refuses it."""


def check_adapter_dir(path: str | Path) -> Path:
    """``path``, once it looks like a PEFT adapter directory: it exists, is a directory, and holds
    ``adapter_config.json`` and ``adapter_model.safetensors``. Checked before anything is sent, so
    a wrong directory is named at once; the store validates the contents.

    Raises:
        FileNotFoundError: It does not exist, or lacks a file (the message names both).
        NotADirectoryError: It is a file.
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"adapter directory {directory} does not exist")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file, not an adapter directory")
    if not (directory / ADAPTER_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"adapter directory {directory} has no {ADAPTER_CONFIG_FILE}")
    if not (directory / ADAPTER_WEIGHTS_FILE).is_file():
        pickled = (directory / PICKLED_WEIGHTS_FILE).is_file()
        instead = f" ({PICKLED_WEIGHTS_FILE} is a pickle, which is not accepted: save it as safetensors)"
        raise FileNotFoundError(
            f"adapter directory {directory} has no {ADAPTER_WEIGHTS_FILE}{instead if pickled else ''}"
        )
    return directory


def upload_stream(path: str | Path, name: str, public: bool, new_version: bool = False) -> Iterator[bytes]:
    """The ``UploadAdapter`` messages for a PEFT adapter directory, serialized (the clients'
    stubs send them as they are: each chunk is copied once, see ``mesh_api.upload_wire``).

    A header, then chunks (``mesh_api.upload_wire.UPLOAD_CHUNK_BYTES`` at most) of
    ``adapter_config.json`` and ``adapter_model.safetensors``, and of ``tokenizer_config.json``
    and ``chat_template.jinja`` when the directory has them (the adapter is then served with
    their chat template). ``new_version``: a publish, which gives a name already registered its
    next version.

    Raises:
        FileNotFoundError: ``path`` does not exist or lacks a file (:func:`check_adapter_dir`).
        NotADirectoryError: ``path`` is a file.
    """
    check_adapter_dir(path)
    visibility = types_pb2.VISIBILITY_PUBLIC if public else types_pb2.VISIBILITY_PRIVATE
    # The owner is left empty: the gateway sets the caller's tenant.
    return upload_wire(read_adapter_dir(path), name, owner="", visibility=visibility, new_version=new_version)
