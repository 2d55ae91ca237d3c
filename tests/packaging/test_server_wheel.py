"""The servers' distribution as a user installs it: the ``loramesh`` wheel built from the
repository carries everything the services read at run time, and installed alone into a clean
venv (its dependencies linked from this interpreter, nothing of the repository importable) it
serves. A worker started from that venv the way the image's entrypoint starts it (``python -m
services.gpu_worker``, here with ``-I``: no current directory, no ``PYTHON*`` variables) serves
the real model, its Q4_1 base weights and a PEFT adapter, with the native CPU kernels it compiles
from the wheel's C sources into an empty cache, and answers with the tokens the repository's
engine computes in this process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest
import torch
from grpc import aio
from support.polling import HANG_GUARD_S
from support.sdk_wheel import REPO, clean_env
from support.server_wheel import ServerVenv, build_server_wheel, server_venv

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from mesh_api.v1 import worker_pb2_grpc
from mesh_api.version import VERSION
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine_config import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.cache_dir import CACHE_ENV, cache_root
from services.runtime.process.process import ServiceProcess
from tests.integration.test_worker_process import generate

pytestmark = [pytest.mark.integration, pytest.mark.model]

KERNEL_SOURCES = sorted(str(path.relative_to(REPO)) for path in REPO.glob("services/**/*.[ch]"))
"""The native kernels' sources in the repository, which the wheel must carry."""
PROMPT = "The capital of France is"
MAX_TOKENS = 8
ADAPTERS = ("", "sql")
"""The requests served: the base model, then an adapter."""

PROBE = """
import importlib.util, json, sys
import loramesh, loramesh_cli, mesh_api, services
(kernels,) = importlib.util.find_spec("services.gpu_worker.kernels").submodule_search_locations
print(json.dumps({
    "modules": [m.__file__ for m in (loramesh, loramesh_cli, mesh_api, services)],
    "kernels": kernels,
    "torch": "torch" in sys.modules,
}))
"""
"""Where the venv's interpreter imports the project's packages from, and the directory the
kernels read their sources from (found without importing them: they import torch)."""


@dataclass
class VenvServiceProcess(ServiceProcess):
    """A service started by another environment's interpreter, isolated (``-I``) from this
    process's current directory and ``PYTHON*`` variables."""

    python: Path = Path()
    """That environment's interpreter."""

    def command(self) -> list[str]:
        return [str(self.python), "-I", *super().command()[1:]]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_server_wheel(tmp_path_factory.mktemp("server-wheel"))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> ServerVenv:
    return server_venv(tmp_path_factory.mktemp("server-venv"), wheel)


def test_the_wheel_carries_the_kernel_sources_the_license_and_the_version(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    assert KERNEL_SOURCES and set(KERNEL_SOURCES) <= names
    assert f"loramesh-{VERSION}.dist-info/licenses/LICENSE" in names
    assert (metadata["Version"], metadata["License-Expression"]) == (VERSION, "Apache-2.0")
    assert wheel.name.startswith(f"loramesh-{VERSION}-")


def test_the_venv_runs_the_wheels_packages_and_command(venv, tmp_path):
    done = subprocess.run(
        [str(venv.python), "-I", "-c", PROBE],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=HANG_GUARD_S, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for path in [*found["modules"], found["kernels"]]:
        assert Path(path).is_relative_to(venv.site), path
    assert not found["torch"]
    kernels = Path(found["kernels"])
    assert [str(p.relative_to(venv.site)) for p in sorted(kernels.glob("*.[ch]"))] == KERNEL_SOURCES
    version = subprocess.run(
        [str(venv.root / "bin" / "loramesh"), "--version"],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=HANG_GUARD_S, env=clean_env(),
    )  # fmt: skip
    assert (version.returncode, version.stdout) == (0, f"loramesh {VERSION}\n"), version.stderr


def reference_tokens(adapter_root: Path, adapters: tuple[str, ...]) -> tuple[list[int], dict[str, list[int]]]:
    """The prompt's tokens, and the repository's engine's greedy tokens for it with each of
    ``adapters`` ("": the base model), one request after the other as the worker gets them."""
    loaded = load_model(quantization="q4_1")
    prompt = loaded.tokenizer.encode(PROMPT)
    engine = local_engine(
        LlamaModel(loaded.config, loaded.weights, torch.float32), EngineConfig(pool_mib=128)
    )
    engine.add_adapter(read_peft_directory("sql", adapter_root / "sql", torch.float32))
    tokens: dict[str, list[int]] = {}
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for adapter in adapters:
        request = GenerationRequest(adapter or "base", tuple(prompt), sampling, adapter or None)
        engine.submit(
            request, lambda event, adapter=adapter: tokens.setdefault(adapter, []).append(event.token_id)
        )
        while engine.has_work():
            engine.step()
    return prompt, tokens


async def test_a_worker_from_the_wheel_serves_with_kernels_built_from_its_sources(venv, tmp_path, base_spec):
    adapters = tmp_path / "adapters"
    write_peft_adapter(adapters / "sql", base_spec, SampleAdapterSpec(rank=8, scale=0.05, seed=3))
    # An empty home: the kernels' cache (~/.cache/loramesh/kernels) starts empty, so the worker
    # compiles them; the converted model is this user's (LORAMESH_CACHE_DIR), not converted again.
    home = tmp_path / "home"
    home.mkdir()
    worker = VenvServiceProcess(
        "gpu_worker",
        ["--adapter-dir", str(adapters), "--dtype", "float32", "--quantization", "q4_1", "--pool-mib", "128"],
        log_path=tmp_path / "worker.log",
        env={"HOME": str(home), CACHE_ENV: str(cache_root())},
        python=venv.python,
    ).start()
    try:
        # The reference is computed while the worker starts (and compiles): a thread of this process.
        reference = asyncio.create_task(asyncio.to_thread(reference_tokens, adapters, ADAPTERS))
        await worker.wait_ready(HANG_GUARD_S)
        prompt, expected = await reference
        async with aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            served = {a: (await generate(stub, prompt, a, MAX_TOKENS))[0] for a in ADAPTERS}
        mapped = Path(f"/proc/{worker.pid}/maps").read_text()
    finally:
        worker.kill()
    assert served == expected
    built = sorted((home / ".cache" / "loramesh" / "kernels").glob("*.so"))
    assert {path.name.split("-")[0] for path in built} >= {"cpu_quant_native", "cpu_lora"}, built
    assert all(str(path) in mapped for path in built), "a kernel the worker did not load"
