"""Every per-adapter series of the worker names the top adapters by requests and sums the rest
under ``other`` (issue 30: bounded label cardinality at 10,000 adapters)."""

from __future__ import annotations

import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.worker_metrics import WorkerMetrics, WorkerParts

PER_ADAPTER = (
    "loramesh_gpu_worker_adapter_generated_tokens",
    "loramesh_gpu_worker_adapter_requests_waiting",
    "vllm:lora_adapter_loaded",
)


def engine_with_adapters(tiny_llama, tmp_path):
    """An engine over the tiny Llama with adapters a, b and c (directories under ``tmp_path``)."""
    engine = local_engine(
        LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32),
        EngineConfig(pool_mib=4, kv_block_tokens=4, max_running=1),
    )
    for seed, name in enumerate(("a", "b", "c")):
        directory = write_peft_adapter(tmp_path / name, tiny_llama.spec, SampleAdapterSpec(rank=4, seed=seed))
        engine.add_adapter(read_peft_directory(name, directory, torch.float32))
    return engine


def test_per_adapter_series_name_the_top_adapter_and_sum_the_rest_as_other(tiny_llama, tmp_path):
    engine = engine_with_adapters(tiny_llama, tmp_path)
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, adapter in enumerate(("a", "a", "b", "c")):
        engine.submit(GenerationRequest(f"r{i}", (5, 6, 7), sampling, adapter), lambda event: None)
    while engine.has_work():
        engine.step()
    engine.submit(GenerationRequest("queued", (5, 6), sampling, "b"), lambda event: None)
    engine.stop()
    metrics = WorkerMetrics(lambda: WorkerParts(engine, None, "tiny"), adapter_label_cap=1)
    families = {family.name: family for family in metrics.collect()}

    def by_label(name: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in families[name].samples if not s.name.endswith("_created")}

    assert by_label("loramesh_gpu_worker_adapter_generated_tokens", "adapter") == {"a": 4, "other": 4}
    # b's queued request (handed over, not taken up yet) counts under other: a has the most requests.
    assert by_label("loramesh_gpu_worker_adapter_requests_waiting", "adapter") == {"other": 1}
    assert by_label("vllm:lora_adapter_loaded", "adapter_name") == {"a": 1, "other": 2}
    # The router's one series of adapter names is not capped (it is bounded by the queue).
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels["waiting_lora_adapters"] == "b"


def test_the_label_cap_is_the_workers_metric_adapter_labels_flag():
    import pytest

    from services.gpu_worker.config import WorkerConfig
    from services.runtime.capped_labels import DEFAULT_CAP
    from services.runtime.config import parse_config

    assert parse_config(WorkerConfig, []).metric_adapter_labels == DEFAULT_CAP
    config = parse_config(WorkerConfig, ["--metric-adapter-labels", "7"])
    assert config.metric_adapter_labels == 7
    assert WorkerMetrics(lambda: None, config.metric_adapter_labels).adapter_label_cap == 7
    with pytest.raises(ValueError, match="at least 1"):  # refused at start, not at a scrape
        WorkerMetrics(lambda: None, 0)


def test_the_pinned_label_is_the_adapters_pin_state(tiny_llama, tmp_path):
    from services.gpu_worker.adapter_loader import AdapterLoader
    from services.gpu_worker.adapter_source import DirectorySource

    engine = engine_with_adapters(tiny_llama, tmp_path)
    loader = AdapterLoader(DirectorySource(tmp_path), engine, torch.float32)
    loader.set_pinned({"a", "b"})
    engine.stop()

    def pinned(cap: int) -> dict[tuple[str, str], float]:
        metrics = WorkerMetrics(lambda: WorkerParts(engine, loader, "tiny"), adapter_label_cap=cap)
        (family,) = [f for f in metrics.collect() if f.name == "vllm:lora_adapter_loaded"]
        return {(s.labels["adapter_name"], s.labels["pinned"]): s.value for s in family.samples}

    assert pinned(3) == {("a", "true"): 1, ("b", "true"): 1, ("c", "false"): 1}
    # Past the cap, the adapters under other are counted pinned and not apart.
    assert pinned(1) == {("a", "true"): 1, ("other", "true"): 1, ("other", "false"): 1}
    loader.set_pinned({"c"})
    assert pinned(3) == {("a", "false"): 1, ("b", "false"): 1, ("c", "true"): 1}
