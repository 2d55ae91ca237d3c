"""Fixtures of the baseline systems' tests: a tiny random Llama as a HF directory, one thread."""

from __future__ import annotations

import pytest
import torch
from support.tiny_hf_model import write_tiny_hf_model


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's matmuls are too small to split: on a busy 2-CPU machine a second
    OpenMP thread makes these tests 3× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"))
