"""The SDK stands alone: its wheel (``loramesh-client``), pip-installed offline into a clean venv
with grpcio and protobuf and nothing of the repository, uploads a real PEFT adapter through the
gateway of a real mesh (TLS, a tenant's key and the CA alone) and generates with it, with both clients; the
repository's own SDK, in this process, gets the same greedy text."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess

import pytest
from support.sdk_wheel import ISOLATED, build_sdk_wheel, clean_env, sdk_venv

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient

pytestmark = [pytest.mark.integration, pytest.mark.model]

PROMPT = "Once upon a time, in a small village by the sea,"
ADAPTER = SampleAdapterSpec(
    rank=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), scale=0.04, seed=7
)
MAX_TOKENS = 8
SAMPLING = {"max_tokens": MAX_TOKENS, "ignore_eos": True}  # greedy

IN_THE_VENV = (
    ISOLATED
    + """
import asyncio, json
from loramesh import AsyncClient, Client, ClientTLS

job = json.loads(sys.argv[1])
options = {"api_key": job["api_key"], "tls": ClientTLS(*job["tls"]), "mesh_file": job["no_mesh_file"]}
out = {}
with Client(job["address"], **options) as client:
    adapter = client.adapters.upload(job["dir"], name="sync-owl")
    out["sync_upload"] = [adapter.owner, adapter.name, adapter.rank, adapter.sha256]
    completion = client.generate(job["prompt"], adapter="sync-owl", **job["sampling"])
    out["sync"] = [completion.text, list(completion.token_ids), completion.finish_reason]


async def with_async_client():
    async with AsyncClient(job["address"], **options) as client:
        adapter = await client.adapters.upload(job["dir"], name="async-owl")
        out["async_upload"] = [adapter.owner, adapter.name, adapter.rank, adapter.sha256]
        completion = await client.generate(job["prompt"], adapter="async-owl", **job["sampling"])
        out["async"] = [completion.text, list(completion.token_ids), completion.finish_reason]
        out["listed"] = sorted(f"{a.owner}/{a.name}" for a in await client.adapters.list())


asyncio.run(with_async_client())
print(json.dumps(out))
"""
)


async def test_the_sdk_wheel_in_a_clean_venv_uploads_and_generates_through_a_real_mesh(
    mesh, tmp_path, base_spec
):
    wheel = build_sdk_wheel(tmp_path / "sdk")
    python, _ = sdk_venv(tmp_path / "client", wheel)
    directory = write_peft_adapter(tmp_path / "owl", base_spec, ADAPTER)
    job = {
        "address": mesh.gateway.address,
        "api_key": "key-alice",
        "tls": [str(mesh.certs.ca_file)],  # a tenant's: the CA alone, no certificate
        "no_mesh_file": str(tmp_path / "absent.json"),
        "dir": str(directory),
        "prompt": PROMPT,
        "sampling": SAMPLING,
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [str(python), "-I", "-c", IN_THE_VENV, json.dumps(job)],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=600, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    print("from the wheel's venv:", out)

    sha256 = hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert out["sync_upload"] == ["alice", "sync-owl", 8, sha256]
    assert out["async_upload"] == ["alice", "async-owl", 8, sha256]
    assert out["listed"] == ["alice/async-owl", "alice/sync-owl"]
    for name in ("sync", "async"):
        text, token_ids, finish = out[name]
        assert text.strip() and len(token_ids) == MAX_TOKENS and finish == "length", out[name]

    # The repository's SDK, in this process, the same requests: the same greedy text and tokens.
    async with AsyncClient(mesh.gateway.address, "key-alice", tls=mesh.client_tls) as client:
        assert sorted(f"{a.owner}/{a.name}" for a in await client.adapters.list()) == out["listed"]
        for name, adapter in (("sync", "sync-owl"), ("async", "async-owl")):
            here = await client.generate(PROMPT, adapter=adapter, **SAMPLING)
            assert [here.text, list(here.token_ids), here.finish_reason] == out[name]
        # Both names are the same adapter bytes: the same output.
        assert out["sync"] == out["async"]
        # And the adapter was applied: the base model continues otherwise (greedy, fixed weights).
        base = await client.generate(PROMPT, **SAMPLING)
        assert list(base.token_ids) != out["sync"][1], base.text
