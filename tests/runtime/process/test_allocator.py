"""services.runtime.process.allocator: freed upload-sized buffers are reused, not faulted in again.

Each case runs in its own interpreter: the setting is process-wide and would outlive the test.
"""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

from services.adapter_store.config import AdapterStoreConfig
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import parse_config

FAULTS_PER_UPLOAD = """
import resource, sys
from mesh_api.upload_wire import UPLOAD_CHUNK_BYTES as CHUNK
from services.runtime.process.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
message = bytes(5 << 20)
def upload():  # as the store receives one: its messages' chunks joined into one buffer, then freed
    parts = [message[start : start + CHUNK] for start in range(0, len(message), CHUNK)]
    joined = b"".join(parts)
    del parts, joined
upload()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    upload()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def faults_per_upload(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_UPLOAD, mode], capture_output=True, text=True, check=True
    )
    return float(done.stdout)


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not ctypes.util.find_library("c"), reason="mallopt is glibc's"
)
def test_retained_buffers_are_reused_without_page_faults():
    plain, retained = faults_per_upload("plain"), faults_per_upload("retain")
    pages_per_upload = (10 << 20) // 4096  # the chunks and the joined copy
    assert plain > pages_per_upload / 4, f"glibc mapped fresh pages for {plain} of an upload's pages"
    assert retained < pages_per_upload / 50, f"{retained} page faults per upload with freed memory retained"


def test_on_where_adapter_bytes_pass_and_off_elsewhere():
    assert parse_config(AdapterStoreConfig, []).retain_freed_memory
    assert parse_config(GatewayConfig, []).retain_freed_memory
    assert not parse_config(WorkerConfig, []).retain_freed_memory
    assert not parse_config(AdapterStoreConfig, ["--retain-freed-memory", "false"]).retain_freed_memory
