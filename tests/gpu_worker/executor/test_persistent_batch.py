"""The persistent decode batch gives the step builder's inputs, step after step, while requests
join, leave, reorder, grow blocks and change adapter; its host work follows the changes."""

from __future__ import annotations

import random
from operator import attrgetter
from types import SimpleNamespace

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from bench.step_host_time import CallCounter
from services.gpu_worker.attention.pool_view import PoolLayout, PoolView
from services.gpu_worker.engine.decode_delta import DecodeDelta, DecodeEncoder
from services.gpu_worker.engine.step_plan import AdapterSlot, PlannedRequest, StepPlan
from services.gpu_worker.executor.persistent_batch import is_plain_decode
from services.gpu_worker.executor.step_builder import StepBuilder
from services.gpu_worker.executor.step_inputs import StepInputs, plan_columns
from services.gpu_worker.memory.adapter_residency import AdapterResidency
from services.gpu_worker.memory.page_allocator import PageUse
from services.gpu_worker.memory.unified_pool import UnifiedPool
from services.model_files.peft_format import LORA_TARGETS
from services.runtime.sampling.sampling_params import SamplingParams

BLOCK = 4
SAMPLES = {
    "a8": SampleAdapterSpec(rank=8, seed=1),
    "a16": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=2),
    "a8-pat": SampleAdapterSpec(rank=8, rank_pattern={"up_proj": 2}, target_modules=LORA_TARGETS, seed=3),
}
SAMPLING = SamplingParams()


class Setup:
    """A CPU pool with the sample adapters placed, a step builder and step inputs over it."""

    def __init__(self, spec, adapters, device_lora: bool):
        layout = PoolLayout(
            num_pages=4096,
            kv_block_tokens=BLOCK,
            kv_dim=spec.num_kv_heads * spec.head_dim,
            num_layers=spec.num_layers,
        )
        self.view = PoolView.zeros(layout, torch.float32)
        self.pool = UnifiedPool(self.view)
        residency = AdapterResidency(self.pool)
        self.resident = {}
        for adapter in adapters:
            placed = residency.load(adapter)
            placed.materialize()
            self.resident[adapter.adapter_id] = placed
        self.builder = StepBuilder(SimpleNamespace(config=spec), self.view)
        self.inputs = StepInputs(
            StepBuilder(SimpleNamespace(config=spec), self.view), device_lora=device_lora
        )

    def slot(self, adapter_id: str | None) -> AdapterSlot | None:
        return None if adapter_id is None else AdapterSlot(adapter_id, self.resident[adapter_id].placement)

    def block(self, layers: int) -> tuple[int, ...]:
        return tuple(self.pool.allocate(layers, PageUse.KV))


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("persistent-batch-adapters")
    return [
        read_peft_directory(name, write_peft_adapter(root / name, tiny_llama.spec, s), torch.float32)
        for name, s in SAMPLES.items()
    ]


def _decode_steps(setup: Setup, layers: int, steps: int, seed: int):
    """Plain decode plans with joins, leaves, reorders, block growth and adapter changes."""
    rng = random.Random(seed)
    names = [None, *SAMPLES]
    live = []
    joined = 0
    for step in range(steps):
        if not live or rng.random() < 0.3:
            position = rng.randrange(1, 30)
            blocks = tuple(setup.block(layers) for _ in range(position // BLOCK + 1))
            live.insert(
                rng.randrange(len(live) + 1),
                {"id": f"r{joined}", "pos": position, "blocks": blocks, "adapter": rng.choice(names)},
            )
            joined += 1
        if len(live) > 1 and rng.random() < 0.2:
            live.pop(rng.randrange(len(live)))
        if len(live) > 2 and rng.random() < 0.1:
            rng.shuffle(live)
        if live and rng.random() < 0.1:
            rng.choice(live)["adapter"] = rng.choice(names)
        yield StepPlan(
            tuple(
                PlannedRequest(
                    request_id=r["id"],
                    token_ids=(rng.randrange(1, 200),),
                    start_position=r["pos"],
                    kv_blocks=r["blocks"],
                    adapter=setup.slot(r["adapter"]),
                    sampling=SAMPLING,
                )
                for r in live
            ),
            "auto",
            False,
        )
        for r in live:
            r["pos"] += 1
            if r["pos"] // BLOCK >= len(r["blocks"]):
                r["blocks"] = (*r["blocks"], setup.block(layers))


def _assert_same_inputs(got, want) -> None:
    for name in ("token_ids", "positions", "write_key_rows", "write_value_rows", "logits_rows"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("token_rows", "key_blocks", "value_blocks", "mask"):
        assert torch.equal(getattr(got.decode, name), getattr(want.decode, name)), name
    assert got.prefills == want.prefills == []
    assert got.local_token_rows is None and got.remote is None


def test_decode_steps_match_the_step_builder(tiny_llama, adapters):
    spec = tiny_llama.spec
    setup = Setup(spec, adapters, device_lora=False)
    for plan in _decode_steps(setup, spec.num_layers, 60, seed=5):
        assert is_plain_decode(plan.requests)
        got = setup.inputs.build(plan, setup.resident.get)
        want = setup.builder.build(plan, setup.resident.get)
        _assert_same_inputs(got, want)
        assert (got.lora is None) == (want.lora is None)


def test_lora_tables_hold_the_step_builders_segments(tiny_llama, adapters):
    spec = tiny_llama.spec
    setup = Setup(spec, adapters, device_lora=True)
    for plan in _decode_steps(setup, spec.num_layers, 40, seed=7):
        got = setup.inputs.build(plan, setup.resident.get)
        want = setup.builder.build(plan, setup.resident.get)
        _assert_same_inputs(got, want)
        if want.lora is None:
            assert got.lora is None
            continue
        for layer in range(spec.num_layers):
            for module, host in want.lora.layers[layer].items():
                device = got.lora.layers[layer][module]
                assert device.rank_starts.tolist() == list(host.rank_starts_host)
                used = host.rank_starts_host[-1]
                assert torch.equal(device.a_offsets[:used], host.a_offsets)
                assert torch.equal(device.b_offsets[:used], host.b_offsets)
                assert torch.equal(device.scales, host.scales)
                assert device.seg_starts_host == host.seg_starts_host and device.is_decode
            for module in set(got.lora.layers[layer]) - set(want.lora.layers[layer]):
                assert not got.lora.layers[layer][module].rank_starts.any()  # no row adapts it


def test_host_work_follows_changes_not_the_batch(tiny_llama, adapters):
    """A steady decode batch writes only the rows that grew a block; the LoRA tables write an
    adapter load once, however many steps and rows use it."""
    spec, layers = tiny_llama.spec, tiny_llama.spec.num_layers
    setup = Setup(spec, adapters, device_lora=True)
    requests = [
        {
            "id": f"r{i}",
            "pos": 4 + i % 3,
            "blocks": (setup.block(layers), setup.block(layers)),
            "adapter": "a16" if i % 2 else "a8",
        }
        for i in range(8)
    ]

    def plan() -> StepPlan:
        return StepPlan(
            tuple(
                PlannedRequest(r["id"], (5,), r["pos"], r["blocks"], setup.slot(r["adapter"]), SAMPLING)
                for r in requests
            ),
            "auto",
            False,
        )

    first = setup.inputs.build(plan(), setup.resident.get)
    batch, tables = setup.inputs.batch, setup.inputs.tables
    assert batch.writes == 8 and tables.slot_writes == 2
    for r in requests:
        r["pos"] += 1  # still inside the second block: nothing to write
    again = setup.inputs.build(plan(), setup.resident.get)
    assert batch.writes == 8 and tables.slot_writes == 2
    assert setup.inputs.encoder.ids == [r["id"] for r in requests]  # the next steady plan is a delta too
    assert again.lora is first.lora  # same segment buffers, kept
    requests[3]["pos"] = 8
    requests[3]["blocks"] = (*requests[3]["blocks"], setup.block(layers))
    setup.inputs.build(plan(), setup.resident.get)
    assert batch.writes == 9  # the one row that grew
    requests[5]["adapter"] = "a8-pat"
    setup.inputs.build(plan(), setup.resident.get)
    assert tables.slot_writes == 3 and batch.writes == 9


def _steady_batch(setup: Setup, layers: int, size: int) -> list[dict]:
    return [
        {
            "id": f"r{i}",
            "pos": 5 + i % 7,
            "blocks": tuple(setup.block(layers) for _ in range(3)),
            "adapter": (None, "a8", "a16")[i % 3],
        }
        for i in range(size)
    ]


def _plan(setup: Setup, requests: list[dict]) -> StepPlan:
    return StepPlan(
        tuple(
            PlannedRequest(
                r["id"], (r["pos"] % 50 + 1,), r["pos"], r["blocks"], setup.slot(r["adapter"]), SAMPLING
            )
            for r in requests
        ),
        "auto",
        False,
    )


def test_deltas_handed_over_give_the_step_builders_inputs(tiny_llama, adapters):
    """The engine's side of the delta interface: the new tokens, the rows that grew a block or
    changed adapter; the rows' inputs and LoRA are the step builder's for the whole plan."""
    spec, layers = tiny_llama.spec, tiny_llama.spec.num_layers
    setup = Setup(spec, adapters, device_lora=True)
    requests = _steady_batch(setup, layers, 6)
    setup.inputs.build(_plan(setup, requests), setup.resident.get)
    rng = random.Random(3)
    for step in range(12):
        grown, readapted = [], []
        for row, r in enumerate(requests):
            r["pos"] += 1
            if r["pos"] // BLOCK >= len(r["blocks"]):
                r["blocks"] = (*r["blocks"], setup.block(layers))
                grown.append((row, r["blocks"]))
        if step % 4 == 1:
            row = rng.randrange(len(requests))
            requests[row]["adapter"] = rng.choice([None, *SAMPLES])
            readapted.append((row, setup.slot(requests[row]["adapter"])))
        plan = _plan(setup, requests)
        delta = DecodeDelta(
            [t[0] for t in map(attrgetter("token_ids"), plan.requests)],
            tuple(grown),
            tuple(readapted),
            request_ids=[r["id"] for r in requests],
        )
        got = setup.inputs.decode(delta, setup.resident.get)
        want = setup.builder.build(plan, setup.resident.get)
        _assert_same_inputs(got, want)
        assert (got.lora is None) == (want.lora is None)


def test_the_encoder_finds_steady_steps_in_full_plans(tiny_llama, adapters):
    spec, layers = tiny_llama.spec, tiny_llama.spec.num_layers
    setup = Setup(spec, adapters, device_lora=True)
    requests = _steady_batch(setup, layers, 4)
    encoder = DecodeEncoder()

    def encode(requests: list[dict]):
        plan = _plan(setup, requests)
        tokens = [r.token_ids[0] for r in plan.requests]
        return encoder.encode(plan_columns(plan), lambda: tokens, plan.lora_backend, plan.batch_invariant)

    assert encode(requests) is None  # nothing to continue
    for r in requests:
        r["pos"] += 1
    requests[2]["blocks"] = (*requests[2]["blocks"], setup.block(layers))
    requests[1]["adapter"] = "a8-pat"
    delta = encode(requests)
    assert delta.grown == ((2, requests[2]["blocks"]),)
    assert delta.readapted == ((1, setup.slot("a8-pat")),)
    assert list(delta.token_ids) == [r["pos"] % 50 + 1 for r in requests]
    assert delta.request_ids is encoder.ids
    requests[0]["pos"] += 3  # a position that does not follow on
    assert encode(requests) is None
    assert encode(requests[1:]) is None  # a request left


def test_a_delta_for_other_rows_is_declined_and_changes_nothing(tiny_llama, adapters):
    """The engine's delta names its rows; steps the inputs did not build as those rows (another
    batch, a prefill in between, the host LoRA path) are declined and the plan is sent."""
    spec, layers = tiny_llama.spec, tiny_llama.spec.num_layers
    setup = Setup(spec, adapters, device_lora=True)
    requests = _steady_batch(setup, layers, 4)
    setup.inputs.build(_plan(setup, requests), setup.resident.get)
    ids = [r["id"] for r in requests]
    assert setup.inputs.decode(DecodeDelta([1, 2, 3], request_ids=ids[1:]), setup.resident.get) is None
    assert setup.inputs.decode(DecodeDelta([1, 2, 3, 4], request_ids=ids), setup.resident.get) is not None
    for r in requests:
        r["pos"] += 2  # the delta above was one step; a plan of the step after it still continues
    assert (
        setup.inputs.encoder.encode(plan_columns(_plan(setup, requests)), lambda: [0] * 4, "auto", False)
        is not None
    )
    host = Setup(spec, adapters, device_lora=False)
    host.inputs.build(_plan(host, requests), host.resident.get)
    assert host.inputs.decode(DecodeDelta([1, 2, 3, 4], request_ids=ids), host.resident.get) is None


def test_a_steady_step_costs_the_same_host_calls_at_any_batch(tiny_llama, adapters):
    """Handed over as a delta with no row changed, a decode step makes the same Python calls and
    tensor operations at batch 3 and 60: nothing per request but the new tokens' one
    conversion."""
    spec, layers = tiny_llama.spec, tiny_llama.spec.num_layers
    counts = []
    for size in (3, 60):
        setup = Setup(spec, adapters, device_lora=True)
        requests = _steady_batch(setup, layers, size)
        setup.inputs.build(_plan(setup, requests), setup.resident.get)
        tokens, ids = [7] * size, setup.inputs.encoder.ids
        delta = DecodeDelta(tokens, request_ids=ids)
        setup.inputs.decode(delta, setup.resident.get)  # the mask's patch from now on
        with CallCounter() as calls:
            setup.inputs.decode(delta, setup.resident.get)
        counts.append(calls.calls)
    assert counts[0] == counts[1]


def test_a_verifying_step_reuses_the_lora_segments_of_a_recent_step(tiny_llama, adapters):
    """A request verifying drafts changes its segment's token count from step to step (1 + k):
    the step builder builds each count's LoRA segments once and hands the same ones back when
    the count comes again, equal to a fresh build; another placement of the adapter is built
    anew."""
    spec = tiny_llama.spec
    setup = Setup(spec, adapters, device_lora=False)
    blocks = tuple(setup.block(spec.num_layers) for _ in range(4))

    def plan(drafts: int, slot: AdapterSlot) -> StepPlan:
        request = PlannedRequest("r", (5,) * (1 + drafts), 8, blocks, slot, SAMPLING, draft_tokens=drafts)
        return StepPlan((request,), "auto", False)

    slot = setup.slot("a16")
    built = {k: setup.builder.build(plan(k, slot), setup.resident.get).lora for k in (0, 3, 0, 5, 3, 0)}
    for k, lora in built.items():
        assert setup.builder.build(plan(k, slot), setup.resident.get).lora is lora
        fresh = StepBuilder(SimpleNamespace(config=spec), setup.view).build(plan(k, slot), setup.resident.get)
        for got, want in zip(lora.layers, fresh.lora.layers, strict=True):
            for name, segments in got.items():
                assert segments.seg_starts_host == want[name].seg_starts_host == (0, 1 + k)
                assert torch.equal(segments.a_offsets, want[name].a_offsets)
    moved = AdapterSlot("a16", slot.placement + 10_000)
    setup.resident[moved.adapter_id] = setup.resident["a16"]
    assert setup.builder.build(plan(3, moved), setup.resident.get).lora is not built[3]


def test_an_evicted_adapters_kept_lora_segments_are_dropped_with_it(tiny_llama, adapters):
    """The step builder keeps recent steps' LoRA segments; forgetting an adapter (its eviction)
    drops every kept step naming it, alone or beside another adapter, and keeps the others'."""
    spec = tiny_llama.spec
    setup = Setup(spec, adapters, device_lora=False)
    blocks = tuple(setup.block(spec.num_layers) for _ in range(4))

    def plan(*adapter_ids: str) -> StepPlan:
        requests = tuple(
            PlannedRequest(f"r{i}", (5,), 8, blocks, setup.slot(a), SAMPLING)
            for i, a in enumerate(adapter_ids)
        )
        return StepPlan(requests, "auto", False)

    def lora(*adapter_ids: str):
        return setup.builder.build(plan(*adapter_ids), setup.resident.get).lora

    kept = {ids: lora(*ids) for ids in (("a8",), ("a16",), ("a8", "a16"))}
    setup.builder.forget_adapter("a16")
    assert lora("a8") is kept[("a8",)]
    assert lora("a16") is not kept[("a16",)]
    assert lora("a8", "a16") is not kept[("a8", "a16")]


def test_steps_with_the_same_adapters_share_their_row_offsets_whatever_their_token_counts(
    tiny_llama, adapters
):
    """A batch verifying drafts keeps its adapters in order while its segments' token counts
    change: each new count's LoRA segments take the row offsets gathered for the first one (the
    same tensors, in every layer after the first, whose segments are built whole as the
    projection's template), equal to a fresh build's; forgetting an adapter (its eviction) drops
    the offsets gathered for batches naming it."""
    spec = tiny_llama.spec
    setup = Setup(spec, adapters, device_lora=False)
    blocks = tuple(setup.block(spec.num_layers) for _ in range(4))

    def plan(drafts: int) -> StepPlan:
        requests = (
            PlannedRequest(
                "r0", (5,) * (1 + drafts), 8, blocks, setup.slot("a8"), SAMPLING, draft_tokens=drafts
            ),
            PlannedRequest("r1", (5,), 8, blocks, setup.slot("a16"), SAMPLING),
        )
        return StepPlan(requests, "auto", False)

    def offsets(lora) -> list:
        return [(seg.a_offsets, seg.b_offsets) for layer in lora.layers[1:] for seg in layer.values()]

    first = offsets(setup.builder.build(plan(0), setup.resident.get).lora)
    for drafts in (1, 2, 3):
        lora = setup.builder.build(plan(drafts), setup.resident.get).lora
        assert all(a is a0 and b is b0 for (a, b), (a0, b0) in zip(offsets(lora), first, strict=True))
        fresh = StepBuilder(SimpleNamespace(config=spec), setup.view).build(plan(drafts), setup.resident.get)
        for (a, b), (fa, fb) in zip(offsets(lora), offsets(fresh.lora), strict=True):
            assert torch.equal(a, fa) and torch.equal(b, fb)
    setup.builder.forget_adapter("a16")
    again = offsets(setup.builder.build(plan(4), setup.resident.get).lora)
    assert not any(a is a0 for (a, _), (a0, _) in zip(again, first, strict=True))
