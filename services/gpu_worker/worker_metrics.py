"""The gpu_worker's own series on ``/metrics``: per adapter, the four the Kubernetes LoRA routers
read (vLLM's names and labels), adapter residency, and DistKV-LLM lending (docs/metrics.md).

Everything is read at scrape time from what is safe to read from another thread: the snapshot
the engine thread publishes after scheduling and after each step (``Engine.stats``), the
hand-over inbox and host copies (under the engine's lock), the lender (its own lock), and the
adapter loader (the event loop's, where scrapes run). Series of adapters or peers that are gone
are simply not yielded, so nothing lingers (a custom collector, not labelled Gauges).

Every per-adapter series names the top adapters by requests and sums the rest under ``other``
(``services/runtime/capped_labels.py``), so a worker's series stay bounded at 10,000 adapters.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gpu_worker.adapter_loader import AdapterLoader
from services.gpu_worker.distkv import DistKvTotals
from services.gpu_worker.engine.engine import Engine
from services.gpu_worker.engine.engine_stats import EngineStats
from services.gpu_worker.engine.speculation.speculator import BASE_MODEL
from services.gpu_worker.prefix_tier import ClusterPrefixTier, PrefixTierCounters
from services.runtime.capped_labels import DEFAULT_CAP, CappedLabels

LOAD_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STEP_WAIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ENGINE_INDEX = "0"
"""vLLM's ``engine`` label: a worker runs one engine."""
GPU, CPU = "gpu", "cpu"
"""vLLM's residency levels: in the engine's device pool (paged in, serves at once), or only a
host copy (paged in at its next request). The pool is on the compute device, CPU or GPU alike."""


@dataclass(frozen=True)
class WorkerParts:
    """What the collector reads, once the worker has started."""

    engine: Engine
    loader: AdapterLoader | None
    """None where no adapter is fetched (a worker lending only, in tests)."""
    model_name: str
    """The base model's name: vLLM's ``model_name`` label."""


class WorkerMetrics:
    """The collector of the worker's series, and the histograms it observes into."""

    def __init__(self, parts: Callable[[], WorkerParts | None], adapter_label_cap: int = DEFAULT_CAP):
        """``parts``: the started worker's parts, None before it has started;
        ``adapter_label_cap``: adapters named in each per-adapter series (the rest: ``other``)."""
        self._parts = parts
        if adapter_label_cap < 1:  # refused at start, not at the first scrape
            raise ValueError(f"the adapter label cap must be at least 1, got {adapter_label_cap}")
        self.adapter_label_cap = adapter_label_cap
        self.prefix_tier: ClusterPrefixTier | None = None
        """The worker's side of the cluster prefix tier (None: off)."""
        self.adapter_load_seconds = Histogram(
            "loramesh_gpu_worker_adapter_load_seconds",
            "Adapter loads by level reached: cpu = pulled from the source and parsed into host RAM, "
            "gpu = paged into the unified pool",
            ["level"],
            buckets=LOAD_BUCKETS_S,
            registry=None,
        )
        self.remote_attention_step_seconds = Histogram(
            "loramesh_gpu_worker_remote_attention_step_seconds",
            "Per engine step with KV on other workers: seconds it waited on their AttendRemote",
            buckets=STEP_WAIT_BUCKETS_S,
            registry=None,
        )

    def attach(self, engine: Engine, loader: AdapterLoader | None) -> None:
        """Observe ``engine``'s page-ins and remote-attention waits and ``loader``'s pulls."""
        engine.adapters.on_paged_in = self.adapter_load_seconds.labels(GPU).observe
        engine.distkv.on_step_wait = self.remote_attention_step_seconds.observe
        if loader is not None:
            loader.on_loaded = self.adapter_load_seconds.labels(CPU).observe

    def collect(self) -> Iterator[Metric]:
        yield from self.adapter_load_seconds.collect()
        yield from self.remote_attention_step_seconds.collect()
        parts = self._parts()
        if parts is None:
            return
        stats = parts.engine.stats()
        running = list(stats.running_adapters)
        # Requests handed over but not yet taken up by the engine thread are queued too.
        waiting = [*stats.waiting_adapters, *parts.engine.hand_over.queued_adapters()]
        if parts.loader is not None:
            waiting += [a for a, count in parts.loader.fetch_waiters().items() for _ in range(count)]
        # Labels name adapters as users do (the store's owner/name), not by their ids.
        named = parts.loader.public_name if parts.loader is not None else str
        running = [None if a is None else named(a) for a in running]
        waiting = [None if a is None else named(a) for a in waiting]
        resident = set(stats.resident_adapters)
        host = {named(a): a in resident for a in parts.engine.host_adapter_ids()}
        pinned = {named(a) for a in parts.loader.pinned_ids()} if parts.loader is not None else set()
        usage = parts.engine.adapter_usage()
        requests, tokens = _by_name(usage.requests, named), _by_name(usage.tokens, named)
        labels = CappedLabels(
            [*host, *tokens, *(a for a in (*running, *waiting) if a is not None)],
            requests,
            self.adapter_label_cap,
        )
        yield from _router_series(parts, stats, running, waiting, host, pinned, labels)
        yield from _adapter_series(running, waiting, tokens, labels)
        yield from _lending_series(parts.engine.lending.lent_to(), stats.borrowed_blocks)
        yield from _compute_cap_series(parts.engine.distkv.totals())
        yield from _policy_series(parts.engine.config.batch_policy, stats)
        yield from _prefix_cache_series(stats)
        if self.prefix_tier is not None:
            yield from _prefix_tier_series(self.prefix_tier.counters)
        if parts.engine.speculator is not None:
            counts = parts.engine.speculator.counts
            # Copies first: a dict of str to int is copied in C under the GIL (engine thread writes).
            drafted, accepted = dict(counts.drafted), dict(counts.accepted)
            yield from _speculation_series(drafted, accepted, named, labels)


def _by_name(counts: dict[str, int], named: Callable[[str], str]) -> dict[str, int]:
    """``counts`` per adapter id, per public name (an adapter's versions share its name)."""
    by_name: dict[str, int] = {}
    for adapter_id, count in counts.items():
        name = named(adapter_id)
        by_name[name] = by_name.get(name, 0) + count
    return by_name


def _router_series(
    parts: WorkerParts,
    stats: EngineStats,
    running: list,
    waiting: list,
    host: dict[str, bool],
    pinned: set[str],
    labels: CappedLabels,
) -> Iterator[Metric]:
    """The series the Gateway API Inference Extension's endpoint picker and llm-d read, with
    vLLM's names, help and labels. ``host``: each adapter with a host copy, and whether it is
    also in the device pool; ``pinned``: the adapters pinned (never evicted). ``vllm:lora_requests_info`` names every adapter running or waiting
    (one series, which the picker reads for affinity; it is bounded by the queue, not by the
    adapters registered); ``vllm:lora_adapter_loaded`` is per adapter, so capped: its ``other``
    series count the adapters past the cap at each level."""
    engine_labels = ["model_name", "engine"]
    engine_values = [parts.model_name, ENGINE_INDEX]
    for name, documentation, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", len(running)),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(waiting)),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage(stats)),
    ):
        family = GaugeMetricFamily(name, documentation, labels=engine_labels)
        family.add_metric(engine_values, value)
        yield family
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    info.add_metric([str(parts.engine.config.max_running), _names(waiting), _names(running)], time.time())
    yield info
    loaded = GaugeMetricFamily(
        "vllm:lora_adapter_loaded",
        "One series per loaded adapter: level gpu = in the device pool, cpu = host copy only.",
        labels=[*engine_labels, "adapter_name", "level", "pinned"],
    )
    # An adapter's pages left in the pool after its host copy was dropped are not "loaded": a
    # request for it pulls it again (they are only reused, and otherwise evicted LRU).
    levels = Counter(
        (labels(name), GPU if on_device else CPU, "true" if name in pinned else "false")
        for name, on_device in host.items()
    )
    for (name, level, is_pinned), count in sorted(levels.items()):
        loaded.add_metric([*engine_values, name, level, is_pinned], count)
    yield loaded
    for level, count in ((GPU, sum(host.values())), (CPU, len(host))):
        family = GaugeMetricFamily(
            f"vllm:num_{level}_loaded_lora_adapters",
            f"Number of adapters loaded in {'the device pool' if level == GPU else 'host RAM'}.",
            labels=engine_labels,
        )
        family.add_metric(engine_values, count)
        yield family


def kv_cache_usage(stats: EngineStats) -> float:
    """Share of the unified pool that new KV cannot have: KV pages (lent ones included) and the
    pages of adapters running requests use. Idle adapters' pages count as free (and the free
    pages include unused cached prefix blocks), as vLLM counts cached but unreferenced blocks:
    they are evicted the moment KV needs them."""
    total = stats.total_pages
    if not total:
        return 0.0
    used = total - stats.free_pages - stats.idle_adapter_pages
    return min(1.0, max(0.0, used / total))


def _names(adapters: Iterable[str | None]) -> str:
    """vLLM's label value: the distinct adapter names, comma-separated (no base-model requests)."""
    return ",".join(sorted({a for a in adapters if a is not None}))


def _adapter_series(
    running: list, waiting: list, tokens: dict[str, int], labels: CappedLabels
) -> Iterator[Metric]:
    for name, documentation, counts in (
        (
            "loramesh_gpu_worker_adapter_requests_running",
            "Requests in the running batch, per adapter",
            running,
        ),
        (
            "loramesh_gpu_worker_adapter_requests_waiting",
            "Requests queued on this worker, per adapter",
            waiting,
        ),
    ):
        family = GaugeMetricFamily(name, documentation, labels=["adapter"])
        for label, count in sorted(Counter(labels(a) for a in counts if a is not None).items()):
            family.add_metric([label], count)
        yield family
    generated = CounterMetricFamily(
        "loramesh_gpu_worker_adapter_generated_tokens", "Tokens generated per adapter", labels=["adapter"]
    )
    for label, count in sorted(labels.sum(tokens).items()):
        generated.add_metric([label], count)
    yield generated


def _speculation_series(
    drafted: dict[str, int], accepted: dict[str, int], named: Callable[[str], str], labels: CappedLabels
) -> Iterator[Metric]:
    """Drafted and accepted tokens of speculative decoding: all requests' (the base model's
    too), and per adapter (their ratio is each adapter's acceptance rate)."""
    for kind, counts, documentation in (
        ("draft", drafted, "Tokens drafted (prompt lookup) and verified in a step"),
        ("accepted_draft", accepted, "Drafted tokens accepted: equal to the token drawn at their position"),
    ):
        yield CounterMetricFamily(
            f"loramesh_gpu_worker_{kind}_tokens", documentation + ", all requests", value=sum(counts.values())
        )
        family = CounterMetricFamily(
            f"loramesh_gpu_worker_adapter_{kind}_tokens", documentation + ", per adapter", labels=["adapter"]
        )
        adapters = {a: n for a, n in counts.items() if a != BASE_MODEL}
        for label, count in sorted(labels.sum(_by_name(adapters, named)).items()):
            family.add_metric([label], count)
        yield family


def _prefix_cache_series(stats: EngineStats) -> Iterator[Metric]:
    """The prefix cache (``--prefix-cache``): prompt blocks found and not found, blocks held."""
    yield CounterMetricFamily(
        "loramesh_gpu_worker_prefix_cache_hit_blocks",
        "Prompt KV blocks found in the prefix cache (their prefill skipped)",
        value=stats.prefix_cache_hit_blocks,
    )
    yield CounterMetricFamily(
        "loramesh_gpu_worker_prefix_cache_missed_blocks",
        "Whole prompt KV blocks looked up in the prefix cache and not found",
        value=stats.prefix_cache_missed_blocks,
    )
    yield GaugeMetricFamily(
        "loramesh_gpu_worker_prefix_cache_blocks",
        "KV blocks in the prefix cache, used by running requests or not",
        value=stats.prefix_cache_blocks,
    )


def _prefix_tier_series(counters: PrefixTierCounters) -> Iterator[Metric]:
    """The cluster prefix tier (``--cluster-prefix-cache on``): counted on the event loop."""
    for name, help_text in (
        ("local_hit_blocks", "Prompt KV blocks found in this worker's prefix cache when the request arrived"),
        (
            "remote_hit_blocks",
            "Prompt KV blocks this worker lacked that the kv_manager placed on another worker",
        ),
        ("fetched_blocks", "Prompt KV blocks fetched from another worker, checked and cached here"),
        ("tokens_saved", "Prompt tokens of the fetched blocks: prefill not computed here"),
        ("rejected_blocks", "Fetched KV blocks that were not the key, shape or dtype asked for (dropped)"),
    ):
        yield CounterMetricFamily(
            f"loramesh_gpu_worker_prefix_tier_{name}", help_text, value=getattr(counters, name)
        )


def _policy_series(policy: str, stats: EngineStats) -> Iterator[Metric]:
    """What the batch policy decided (docs/batch-policies.md): the LoRA mode, switches, aborts,
    and the policy's own counters and knobs."""
    yield GaugeMetricFamily(
        "loramesh_gpu_worker_lora_mode_merged",
        "1 while an adapter is merged into the base weights (dLoRA)",
        value=stats.lora_mode_merged,
    )
    yield CounterMetricFamily(
        "loramesh_gpu_worker_lora_mode_switches",
        "Merges and unmerges of adapters into the base weights",
        value=stats.lora_mode_switches,
    )
    yield CounterMetricFamily(
        "loramesh_gpu_worker_aborted_requests",
        "Requests the batch policy aborted (first-token SLO lost)",
        value=stats.aborted_requests,
    )
    decisions = GaugeMetricFamily(
        "loramesh_gpu_worker_batch_policy_decision",
        "The batch policy's counters and knobs (e.g. dlora's alpha, beta, max_credits, merged_share)",
        labels=["policy", "decision"],
    )
    for key, value in sorted(stats.batch_policy_decisions.items()):
        decisions.add_metric([policy, key], value)
    yield decisions


def _compute_cap_series(totals: DistKvTotals) -> Iterator[Metric]:
    """DistKV-LLM's compute cap (``--lend-compute-share``), from both sides."""
    yield CounterMetricFamily(
        "loramesh_gpu_worker_lent_attention_refused",
        "AttendRemote calls this worker refused as a creditor, over its --lend-compute-share",
        value=totals.lent_attention_refused,
    )
    yield CounterMetricFamily(
        "loramesh_gpu_worker_remote_attention_refused",
        "Steps whose remote attention a creditor refused over its compute cap (recomputed here)",
        value=totals.remote_attention_refused,
    )


def _lending_series(lent: dict[str, int], borrowed: dict[str, int]) -> Iterator[Metric]:
    for name, documentation, blocks in (
        ("loramesh_gpu_worker_kv_blocks_lent", "KV blocks of this pool lent to a peer (its debtor)", lent),
        (
            "loramesh_gpu_worker_kv_blocks_borrowed",
            "KV blocks this worker holds on a peer (its creditor)",
            borrowed,
        ),
    ):
        family = GaugeMetricFamily(name, documentation, labels=["peer"])
        for peer, count in sorted(blocks.items()):
            family.add_metric([peer], count)
        yield family
