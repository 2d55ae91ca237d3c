"""The llama.cpp systems: the bench's PEFT adapters converted to GGUF LoRA by llama.cpp's own
converter (cached by content), llama-server serving a short trace with and without them, and
llama-server at batch 1 with named adapters (the served speculative bench's peer).

Both need a llama.cpp checkout with llama-server built in it (docs/benchmarks.md): set
``LORAMESH_LLAMA_SERVER`` to the binary, else these tests skip."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file
from support.tiny_hf_model import SPEC

from bench.serving.adapters import ensure_adapter_set
from bench.serving.system_settings import LLAMA_SERVER_ENV
from bench.systems.base import RunContext
from bench.systems.llamacpp_adapters import ConversionError, find_converter, gguf_adapters
from bench.systems.llamacpp_lora_server import LlamaLoraServer
from bench.systems.llamacpp_system import LlamaServerSystem, LlamaServerSystemOptions
from bench.workload import TraceRequest
from services.model_files.base_model import default_model_path


@pytest.fixture
def llama_server() -> Path:
    binary = os.environ.get(LLAMA_SERVER_ENV, "")
    if not binary:
        pytest.skip(
            f"no llama-server configured: set {LLAMA_SERVER_ENV} to one built in its llama.cpp checkout"
        )
    return Path(binary)


def test_a_binary_outside_a_llama_cpp_checkout_is_refused_by_name(tmp_path):
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.touch()
    with pytest.raises(ConversionError, match="no convert_lora_to_gguf.py in any directory above"):
        find_converter(binary)


def test_adapters_are_converted_once_keyed_by_content_and_arrive_intact(llama_server, tmp_path):
    from gguf import GGUFReader

    adapters = ensure_adapter_set(tmp_path / "adapters", SPEC, 2, (4, 8))
    converter = find_converter(llama_server)

    files = gguf_adapters(adapters, SPEC, converter)

    assert [f.parent for f in files] == [tmp_path / "adapters-gguf"] * 2 and files[0] != files[1]
    reader = GGUFReader(files[1])
    assert bytes(reader.fields["adapter.type"].parts[-1]).decode() == "lora"
    assert reader.fields["adapter.lora.alpha"].parts[-1][0] == 16.0
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == SPEC.num_layers * 4 * 2  # q/k/v/o, A and B
    peft = load_file(adapters.directory(1) / "adapter_model.safetensors")
    for gguf_name, peft_name in [
        ("attn_v.weight.lora_b", "v_proj.lora_B"),
        ("attn_output.weight.lora_a", "o_proj.lora_A"),
    ]:
        expected = peft[f"base_model.model.model.layers.0.self_attn.{peft_name}.weight"].numpy()
        assert (tensors[f"blk.0.{gguf_name}"].data == expected).all()  # v and o are not permuted

    written = [f.stat().st_mtime_ns for f in files]
    assert gguf_adapters(adapters, SPEC, converter) == files
    assert [f.stat().st_mtime_ns for f in files] == written  # cached, not converted again
    config_path = adapters.directory(0) / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "lora_alpha": 4.0}))
    changed = gguf_adapters(adapters, SPEC, converter)
    assert changed[0] != files[0] and changed[1] == files[1]


@pytest.mark.model
@pytest.mark.parametrize("with_adapters", [True, False], ids=["llamacpp", "llamacpp-base"])
def test_llama_server_serves_three_requests_with_their_tokens(
    llama_server, base_spec, tmp_path, with_adapters
):
    adapters = ensure_adapter_set(tmp_path / "adapters", base_spec, 2, (8, 16))
    trace = [
        TraceRequest(0.1 * i, adapter=i % 2, rank=8, input_len=5 + i, output_len=3 + i, request_id=f"req-{i}")
        for i in range(3)
    ]
    system = LlamaServerSystem(LlamaServerSystemOptions(binary=llama_server, with_adapters=with_adapters))

    records = system.run(RunContext(trace=trace, adapters=adapters, window_s=math.inf, max_batch=4))

    assert all(not r.error and r.completed and r.output_tokens == r.output_len for r in records), records
    assert all(r.arrival_s <= r.first_token_s <= r.finish_s for r in records)
    stats = system.stats()
    assert stats["drained"] and stats["lora_files"] == (2 if with_adapters else 0)
    assert "-np" in stats["flags"] and stats["version"]


@pytest.mark.model
def test_each_batch_one_request_streams_its_tokens_on_its_own_adapter(llama_server, base_spec, tmp_path):
    adapters = ensure_adapter_set(tmp_path / "adapters", base_spec, 2, (8, 16))
    named = {"first": adapters.directory(0), "second": adapters.directory(1)}
    server = LlamaLoraServer(llama_server, default_model_path(), named, context=512)
    try:
        assert server.lora_ids == {"first": 0, "second": 1} and server.version
        with httpx.Client(timeout=120) as client:
            answers = [
                server.stream(client, [1000 + j for j in range(12)], a, 6) for a in ("", "first", "second")
            ]
        for answer in answers:
            assert len(answer["tokens"]) == 6 and answer["start"] <= answer["first"] <= answer["last"]
        assert server.body([1], "second", 3)["lora"] == [{"id": 1, "scale": 1.0}]
        assert server.body([1], "", 3)["lora"] == []
    finally:
        server.close()
    bare = LlamaLoraServer(llama_server, default_model_path(), {}, context=512)
    try:
        assert "--lora-init-without-apply" not in bare.flags
        with httpx.Client(timeout=120) as client:
            assert len(bare.stream(client, [1000 + j for j in range(12)], "", 4)["tokens"]) == 4
    finally:
        bare.close()
