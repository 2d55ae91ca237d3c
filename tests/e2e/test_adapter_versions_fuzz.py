"""A bounded slice (6 publishes) of the fuzz campaign (bench/adapter_version_fuzz.py runs the
10,000 publishes): on a mesh of two workers with merged mode allowed (the dlora batch policy) and
the prefix cache on, one adapter name is published again and again, in turn between three PEFT
adapters (publishes after the first three are rollbacks to a kept version's content), while
requests stream on it. No answer comes from a version older than the newest published before it
was sent; each names the sha256 its version was published with; each content's answer is one,
whatever version served it (a rollback serves the old text again), and it is transformers +
peft's."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from support.hf_peft import hf_logits, near_ties
from support.mesh import Mesh, running_mesh

from bench.adapter_version_fuzz import GREEDY, PROMPT, WORKER_FLAGS, fuzz, write_contents
from loramesh import AsyncClient
from services.gpu_worker.model.loading import load_model

pytestmark = [pytest.mark.integration, pytest.mark.model]

PUBLISHES = 6
"""Versions 4 to 6 are rollbacks to the three contents published first."""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("fuzz-mesh"), workers=2, worker_flags=WORKER_FLAGS) as mesh:
        yield mesh


async def test_publishes_while_requests_stream_give_no_stale_or_wrong_answer(mesh, tmp_path):
    contents = write_contents(tmp_path, 3)
    async with AsyncClient(mesh.gateway.address, "key-alice") as client:
        report = await fuzz(client, "policy", contents, PUBLISHES, streams=2, paced=True)

    summary = report.summary()
    assert summary["publishes"] == PUBLISHES and summary["answers"] > 0
    assert report.stale() == [] and report.mislabelled() == []
    by_content = report.by_content()
    assert all(len(answers) == 1 for answers in by_content.values()), "one content, two answers"
    rolled_back = {a.sha256 for a in report.answers if a.version > len(contents)}
    assert rolled_back, "no answer came from a rollback: the slice shows nothing"

    loaded = load_model()
    prompt = loaded.tokenizer.encode(PROMPT)
    directories = {
        hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest(): d for d in contents
    }
    for sha256, answers in by_content.items():
        (tokens,) = answers
        assert len(tokens) == GREEDY["max_tokens"]
        reference, _ = hf_logits(loaded, directories[sha256], prompt, list(tokens))
        near_ties(list(tokens), reference)
