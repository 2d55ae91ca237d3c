"""A GGUF's file type read from its header alone: the wheel's model and files written here."""

from __future__ import annotations

import pytest
from gguf import GGUFWriter

from services.model_files.base_model import default_model_path
from services.model_files.gguf_file_type import gguf_file_type


def write_gguf(path, file_type: int | None) -> None:
    """A header-only GGUF: a string, an array of strings (as a vocabulary is) and the file type."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_token_list(["a", "bb", "ccc"])
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_the_wheels_model_is_q4_1():
    assert gguf_file_type(default_model_path()) == "q4_1"


@pytest.mark.parametrize(
    ("value", "name"), [(0, "f32"), (1, "f16"), (7, "q8_0"), (32, "bf16"), (15, "other")]
)
def test_a_written_file_type(tmp_path, value, name):
    write_gguf(tmp_path / "m.gguf", value)
    assert gguf_file_type(tmp_path / "m.gguf") == name


def test_no_file_type_key_is_unknown(tmp_path):
    write_gguf(tmp_path / "m.gguf", None)
    assert gguf_file_type(tmp_path / "m.gguf") == "unknown"


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_file_type(tmp_path / "m.gguf")
