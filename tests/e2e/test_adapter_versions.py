"""Adapter versions through the whole mesh (issue 52, the request side), as a training loop sees
them: it publishes checkpoints of one adapter name through the SDK and asks for completions.

A request naming ``name`` is served by the version newest when the gateway admitted it, for its
whole life: a stream started before a publish finishes on its old version, byte-identical to
that version's answer. ``name@N`` and ``name@sha256:`` serve that version (a version a newer one
replaced too, while the store keeps it), a rollback serves the old text again; every response says
which version served it (the SDK's ``served_by``, OpenAI's ``system_fingerprint``, LoRAX's
``details``). Each answer is checked against transformers + peft on that version's weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from support.hf_peft import hf_logits, near_ties
from support.mesh import Mesh, running_mesh
from support.polling import HANG_GUARD_S

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient, Client, Completion, NotFound
from services.gpu_worker.model.loading import load_model

pytestmark = [pytest.mark.integration, pytest.mark.model]

PROMPT = "Write one sentence about the sea."
MAX_TOKENS = 12
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def checkpoints(base_spec, tmp_path_factory):
    """Two checkpoints of one adapter: different weights, each changing the greedy text."""
    root = tmp_path_factory.mktemp("checkpoints")
    return [
        write_peft_adapter(root / f"step-{seed}", base_spec, SampleAdapterSpec(rank=8, scale=0.04, seed=seed))
        for seed in (21, 22)
    ]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("versions-mesh"), workers=1) as mesh:
        yield mesh


def check_against_peft(loaded, directory, completion: Completion) -> None:
    """``completion`` is transformers + peft's greedy answer on ``directory``'s weights (a step
    whose reference top two are a near tie may pick either)."""
    prompt = loaded.tokenizer.encode(PROMPT)
    tokens = list(completion.token_ids)
    assert len(tokens) == MAX_TOKENS
    reference, _ = hf_logits(loaded, directory, prompt, tokens)
    if not near_ties(tokens, reference):
        assert completion.text == loaded.tokenizer.decode(tokens)


async def test_a_publish_serves_requests_admitted_after_it_and_no_stream_started_before(
    mesh, loaded, checkpoints
):
    old_dir, new_dir = checkpoints
    async with AsyncClient(mesh.gateway.address, "key-alice") as client:
        first = await client.adapters.publish(old_dir, "policy")
        assert (first.version, first.changed) == (1, True)
        again = await client.adapters.publish(old_dir, "policy")  # the same content: nothing new
        assert (again.version, again.id, again.changed) == (1, first.id, False)

        old = await client.generate(PROMPT, adapter="policy", **GREEDY)
        assert old.served_by.fingerprint == f"policy@1 sha256:{first.sha256[:12]}"
        assert old.served_by.adapter_id == first.id
        for pinned in ("policy@1", f"policy@sha256:{first.sha256[:12]}", f"policy@sha256:{first.sha256}"):
            assert (await client.generate(PROMPT, adapter=pinned, **GREEDY)).token_ids == old.token_ids

        # A stream admitted on version 1; version 2 is published while it is open.
        stream = client.stream(PROMPT, adapter="policy", **GREEDY)
        opened = await anext(stream)
        assert opened.served_by.version == 1
        second = await client.adapters.publish(new_dir, "policy")
        assert (second.version, second.changed) == (2, True) and second.sha256 != first.sha256
        new = await client.generate(PROMPT, adapter="policy", **GREEDY)
        rest = [delta async for delta in stream]
        streamed = [opened, *rest]
        # The stream finished on version 1: byte-identical to version 1's answer.
        assert "".join(d.text for d in streamed) == old.text
        assert [t for d in streamed for t in d.token_ids] == list(old.token_ids)
        assert not any(d.served_by for d in rest)

        assert new.served_by.fingerprint == f"policy@2 sha256:{second.sha256[:12]}"
        assert new.token_ids != old.token_ids, "the two checkpoints answer alike: the test shows nothing"
        for pinned in ("policy@2", f"policy@sha256:{second.sha256}"):
            assert (await client.generate(PROMPT, adapter=pinned, **GREEDY)).token_ids == new.token_ids
        with pytest.raises(NotFound, match="adapter 'policy' of owner 'alice' has no version 7"):
            await client.generate(PROMPT, adapter="policy@7", **GREEDY)
        # Version 1 is kept (the store's --keep-versions): still served when named.
        pinned_old = await client.generate(PROMPT, adapter="policy@1", **GREEDY)
        assert (pinned_old.token_ids, pinned_old.served_by.version) == (old.token_ids, 1)

        # A rollback: version 1's content published again is version 3, serving version 1's text.
        rollback = await client.adapters.publish(old_dir, "policy")
        assert (rollback.version, rollback.sha256, rollback.changed) == (3, first.sha256, True)
        rolled = await client.generate(PROMPT, adapter="policy", **GREEDY)
        assert rolled.text == old.text and rolled.served_by.version == 3
        by_content = await client.generate(PROMPT, adapter=f"policy@sha256:{first.sha256[:12]}", **GREEDY)
        assert by_content.served_by.version == 3  # the newest version with that content

    check_against_peft(loaded, old_dir, old)
    check_against_peft(loaded, new_dir, new)


async def test_the_http_apis_name_the_version_that_served(mesh, checkpoints):
    old_dir, new_dir = checkpoints

    def publish_both():  # through the synchronous client this time
        with Client(mesh.gateway.address, "key-alice") as client:
            return [client.adapters.publish(d, "http-policy") for d in (old_dir, new_dir)]

    first, second = await asyncio.to_thread(publish_both)
    assert (first.version, second.version, second.changed) == (1, 2, True)
    async with AsyncClient(mesh.gateway.address, "key-alice") as client:
        expected = await client.generate(PROMPT, adapter="http-policy", **GREEDY)
    auth = {"authorization": "Bearer key-alice"}
    async with httpx.AsyncClient(base_url=mesh.openai_base_url.removesuffix("/v1"), headers=auth,
                                 timeout=HANG_GUARD_S) as http:  # fmt: skip
        body = {"model": "http-policy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        completion = (await http.post("/v1/completions", json=body)).json()
        assert completion["system_fingerprint"] == f"http-policy@2 sha256:{second.sha256[:12]}"
        assert completion["choices"][0]["text"] == expected.text
        lorax = {"inputs": PROMPT, "parameters": {"adapter_id": f"http-policy@sha256:{second.sha256[:12]}",
                                                  "max_new_tokens": 2, "details": True}}  # fmt: skip
        details = (await http.post("/generate", json=lorax)).json()["details"]
        assert details["adapter_version"] == f"http-policy@2 sha256:{second.sha256[:12]}"
        missing = await http.post("/v1/completions", json={**body, "model": "http-policy@3"})
        assert missing.status_code == 404 and "http-policy@3" in missing.text
