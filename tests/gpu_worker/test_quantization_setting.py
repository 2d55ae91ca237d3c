"""What ``--quantization auto`` runs: a quantized source keeps its own format on a CPU worker,
any other source keeps its precision (vLLM never quantizes unasked), and a GPU or a
tensor-parallel group runs unquantized."""

from __future__ import annotations

import json

import pytest

from services.gpu_worker.quantization_setting import resolve_quantization, source_format
from services.model_files.base_model import default_model_path
from tests.model_files.test_gguf_file_type import write_gguf


@pytest.fixture
def hf_bf16_dir(tmp_path):
    """A Hugging Face model directory as a bf16 checkpoint ships (only its name matters here)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_the_default_model_keeps_its_q4_1_blocks_on_cpu():
    assert source_format(None) == source_format("") == source_format(default_model_path()) == "q4_1"
    assert resolve_quantization("auto", "cpu") == "q4_1"
    assert resolve_quantization("auto", "cpu", 1, default_model_path()) == "q4_1"


def test_a_safetensors_model_is_not_quantized_by_auto(hf_bf16_dir):
    assert resolve_quantization("auto", "cpu", 1, hf_bf16_dir) == "none"
    assert resolve_quantization("auto", "cpu", 1, str(hf_bf16_dir)) == "none"


@pytest.mark.parametrize(
    ("file_type", "expected"), [(0, "none"), (1, "none"), (32, "none"), (7, "q8_0"), (2, "none")]
)
def test_a_gguf_keeps_its_own_format(tmp_path, file_type, expected):
    """An f32/f16/bf16 GGUF stays unquantized, a Q8_0 one keeps Q8_0, and a block format the
    kernels do not run (Q4_0) is dequantized rather than requantized."""
    write_gguf(tmp_path / "m.gguf", file_type)
    assert resolve_quantization("auto", "cpu", 1, tmp_path / "m.gguf") == expected


def test_a_missing_path_is_left_to_the_loader(tmp_path):
    assert source_format(tmp_path / "absent.gguf") == "none"


def test_gpu_and_tensor_parallel_run_unquantized():
    assert resolve_quantization("auto", "cuda") == "none"
    assert resolve_quantization("auto", "cpu", tp=3) == "none"


def test_asking_quantizes_any_source_on_cpu(hf_bf16_dir):
    assert resolve_quantization("q4_1", "cpu", 1, hf_bf16_dir) == "q4_1"
    assert resolve_quantization("q8_0", "cpu", 1, hf_bf16_dir) == "q8_0"
    with pytest.raises(ValueError, match="--quantization q4_1 runs on a CPU worker"):
        resolve_quantization("q4_1", "cuda", 1, hf_bf16_dir)
