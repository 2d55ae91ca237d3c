"""``make demo``: bring a local mesh up, register sample adapters, list and fetch them, take it down.

Everything goes through the same commands a user types (``loramesh up/adapters/status/down``)
plus one programmatic fetch that verifies each adapter's checksum end to end.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path

from grpc import aio

from loramesh.cli.main import main as loramesh
from loramesh.cli.mesh_file import MeshFile
from loramesh.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from loramesh.v1 import adapter_store_pb2_grpc
from services.adapter_store.client import fetch_adapter, ref_by_name
from services.runtime.base_model import LORA_TARGETS, load_base_model_spec

SAMPLES = {
    "sql-r8": SampleAdapterSpec(rank=8, seed=1),
    "chat-r16-mlp": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=2),
    "code-r32-rslora": SampleAdapterSpec(rank=32, use_rslora=True, rank_pattern={"o_proj": 8}, seed=3),
}


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(*argv: str) -> None:
    print("$ loramesh " + " ".join(argv), flush=True)
    code = loramesh(list(argv))
    if code != 0:
        raise SystemExit(f"demo failed at: loramesh {' '.join(argv)}")


async def fetch_all(address: str, files: dict[str, dict[str, bytes]]) -> None:
    async with aio.insecure_channel(address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        for name, parts in files.items():
            started = time.perf_counter()
            info, data = await fetch_adapter(stub, ref_by_name("admin", name))
            ms = (time.perf_counter() - started) * 1000
            same = data == parts["adapter_model.safetensors"]
            print(f"fetched {name:<16} {len(data):>9} bytes in {ms:6.1f} ms  sha256 {info.sha256[:16]}  "
                  f"identical to upload: {same}")  # fmt: skip
            if not same or hashlib.sha256(data).hexdigest() != info.sha256:
                raise SystemExit(f"demo failed: {name} came back different")


def main() -> int:
    spec = load_base_model_spec()
    step("start the mesh (etcd + adapter store)")
    run("up", "--detach")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            step(f"write {len(SAMPLES)} sample PEFT adapters for {spec.name}")
            files = {}
            for name, sample in SAMPLES.items():
                directory = write_peft_adapter(Path(tmp) / name, spec, sample)
                files[name] = adapter_files(directory)
                run("adapters", "upload", str(directory), "--name", name)
            step("list them")
            run("adapters", "list")
            step("fetch each one back and verify it")
            mesh = MeshFile.read()
            asyncio.run(fetch_all(mesh.services["adapter_store"].address, files))
            step("mesh status")
            time.sleep(1.2)  # load reports are written every second; show one taken after the uploads
            run("status")
    finally:
        step("stop the mesh")
        run("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
