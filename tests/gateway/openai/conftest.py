"""A real mesh (etcd, store, 1 worker, scheduler, gateway) for the OpenAI API tests, one per
test module, with adapters registered through the SDK (gRPC) and the gateway allowed to load
adapter directories from the tests' temporary tree."""

from __future__ import annotations

import asyncio

import pytest
from support.mesh import Mesh, start_mesh, wait_for_workers

from loramesh import Client
from loramesh_cli.sample_adapters import SampleAdapterSpec, write_peft_adapter


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("openai-adapters")


@pytest.fixture(scope="module")
def adapter_dirs(adapter_root, base_spec):
    """Three small PEFT adapters strong enough to change greedy outputs."""
    return {
        name: write_peft_adapter(
            adapter_root / name, base_spec, SampleAdapterSpec(rank=8, scale=0.04, seed=seed)
        )
        for name, seed in (("pirate", 11), ("french", 12), ("secret", 13))
    }


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, adapter_root, adapter_dirs) -> Mesh:
    """alice owns ``pirate`` and ``french`` (private) ; bob owns ``secret`` (private)."""
    root = tmp_path_factory.mktemp("openai-mesh")

    async def start() -> Mesh:
        started = await start_mesh(root, workers=1, gateway_flags=("--adapter-load-dirs", str(adapter_root)))
        try:
            await wait_for_workers(started, 1)
        except BaseException:
            started.stop()
            raise
        return started

    mesh = asyncio.run(start())
    try:
        with (
            Client(mesh.gateway.address, "key-alice") as alice,
            Client(mesh.gateway.address, "key-bob") as bob,
        ):
            alice.adapters.upload(adapter_dirs["pirate"], "pirate")
            alice.adapters.upload(adapter_dirs["french"], "french")
            bob.adapters.upload(adapter_dirs["secret"], "secret")
        yield mesh
    finally:
        mesh.stop()
