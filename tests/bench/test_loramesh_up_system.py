"""The loramesh-up system end to end on the tiny model: `loramesh up --detach` on a scratch state
directory, adapters uploaded, the trace replayed through the gateway's OpenAI API by the shared
HTTP client, `loramesh down`."""

from __future__ import annotations

import math
import shutil

import pytest
from support.tiny_hf_model import SPEC

from bench.serving.adapters import ensure_adapter_set
from bench.systems.base import RunContext
from bench.systems.loramesh_up_system import LoraMeshUpSystem, LoraMeshUpSystemOptions
from bench.workload import TraceRequest
from services.model_files.base_model import load_base_model_spec

pytestmark = pytest.mark.integration

# One process of each kind: the replicas change nothing here and cost start-up time.
LEAN_MESH = ("--gateways", "1", "--schedulers", "1", "--kv-managers", "1")


@pytest.fixture
def served_model_dir(model_dir, tmp_path):
    """The tiny model with a tokenizer covering its whole vocabulary: the gateway refuses prompt
    token ids its tokenizer does not know (the shared tiny model's knows three)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    served = shutil.copytree(model_dir, tmp_path / "model")
    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, SPEC.vocab_size)}}
    Tokenizer(WordLevel(vocabulary, unk_token="<unk>")).save(str(served / "tokenizer.json"))
    return served


def test_every_request_completes_with_its_tokens_through_the_openai_api(served_model_dir, tmp_path):
    model_dir = served_model_dir
    adapters = ensure_adapter_set(tmp_path / "adapters", load_base_model_spec(model_dir), 2, (4,))
    trace = [
        TraceRequest(0.1 * i, adapter=i % 2, rank=4, input_len=5 + i, output_len=3 + i, request_id=f"req-{i}")
        for i in range(3)
    ]
    context = RunContext(trace=trace, adapters=adapters, window_s=math.inf, model_path=str(model_dir),
                         max_batch=4, pool_mib=32, host_cache_mib=8)  # fmt: skip
    system = LoraMeshUpSystem(LoraMeshUpSystemOptions(up_args=LEAN_MESH))

    records = system.run(context)

    assert [r.request_id for r in records] == [t.request_id for t in trace]
    assert all(not r.error and r.completed and r.output_tokens == r.output_len for r in records), records
    assert all(r.arrival_s <= r.first_token_s <= r.finish_s for r in records)
    stats = system.stats()
    assert stats["up_flags"][-len(LEAN_MESH) :] == list(LEAN_MESH)
    assert stats["environment"]["LORAMESH_MAX_RUNNING"] == "4"
