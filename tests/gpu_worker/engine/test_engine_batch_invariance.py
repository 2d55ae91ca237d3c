"""Deterministic serving on the real model: a request's output does not depend on its batch.

SmolLM2-135M in fp32 and in bf16 storage, ``EngineConfig(deterministic=True)``: 8 greedy prompts on
mixed real PEFT adapters (and the base model), each run alone, and each inside a batch of 16
other requests (other prompts, adapters and lengths; some there before it, some arriving while it
decodes). Their logits at every step, hence their tokens, are the same bits. A request's
continuation re-prefilled from its prompt and first tokens (what a failover does on another
worker) yields the logits and tokens of the undisturbed run, in a batch of others too.
"""

from __future__ import annotations

import random

import pytest
import torch

from bench.sample_adapters import SampleAdapterSpec, read_peft_directory, write_peft_adapter
from services.gpu_worker.build import local_engine
from services.gpu_worker.engine.engine import EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.engine.sampling import SamplingParams
from services.gpu_worker.kernels.cpu_invariant import invariant_available, invariant_error
from services.gpu_worker.model.llama import LlamaModel
from services.gpu_worker.model.loading import load_model
from services.model_files.peft_format import LORA_TARGETS

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not invariant_available(), reason=f"no native kernels: {invariant_error()}"),
]

NEW_TOKENS = 12
RESUME_AFTER = 5
"""Generated tokens a re-prefilled continuation starts from."""
ADAPTERS = {
    "r8-attn": SampleAdapterSpec(rank=8, seed=21),
    "r16-all": SampleAdapterSpec(rank=16, target_modules=LORA_TARGETS, seed=22),
    "r64-all": SampleAdapterSpec(rank=64, target_modules=LORA_TARGETS, lora_alpha=32.0, seed=23),
}
TARGET_ADAPTERS = ["r8-attn", None, "r16-all", "r64-all", "r16-all", "r8-attn", None, "r64-all"]
TEXT = (
    "In the beginning the universe was created. This has made a lot of people very angry and been "
    "widely regarded as a bad move. Many were increasingly of the opinion that they had all made a "
    "big mistake in coming down from the trees in the first place. And some said that even the "
    "trees had been a bad move, and that no one should ever have left the oceans."
)


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture(scope="module")
def adapter_dirs(base_spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(root / name, base_spec, sample) for name, sample in ADAPTERS.items()}


class Run:
    """One engine run: requests submitted at given steps, every step's logits and tokens kept."""

    def __init__(self, model: LlamaModel, adapter_dirs: dict, dtype: torch.dtype):
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.engine = local_engine(
            model,
            EngineConfig(pool_mib=256, deterministic=True),
            on_logits=lambda rid, row: self.logits.setdefault(rid, []).append(row.clone()),
        )
        for name, directory in adapter_dirs.items():
            self.engine.add_adapter(read_peft_directory(name, directory, dtype))

    def submit(self, request_id: str, prompt: list[int], adapter: str | None, max_tokens: int = NEW_TOKENS):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.engine.submit(GenerationRequest(request_id, tuple(prompt), sampling, adapter), self._sink)

    def _sink(self, event) -> None:
        if event.token_id is not None:
            self.tokens.setdefault(event.request_id, []).append(event.token_id)

    def until_done(self, arrivals: dict[int, list[tuple]] | None = None) -> Run:
        """Step until idle; ``arrivals[step]``: (id, prompt, adapter[, max_tokens]) submitted
        before that step."""
        arrivals = arrivals or {}
        step = 0
        while self.engine.has_work() or step in arrivals:
            for request in arrivals.get(step, []):
                self.submit(*request)
            self.engine.step()
            step += 1
        return self


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_are_the_same_alone_and_in_batches_and_after_a_re_prefill(loaded, adapter_dirs, dtype):
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    ids = loaded.tokenizer.encode(TEXT)
    rng = random.Random(7)
    targets = [ids[i * 3 : i * 3 + n] for i, n in enumerate((9, 23, 5, 31, 14, 40, 3, 18))]
    alone = {}
    for i, prompt in enumerate(targets):
        run = Run(model, adapter_dirs, dtype)
        run.submit(f"t{i}", prompt, TARGET_ADAPTERS[i])
        alone[f"t{i}"] = run.until_done()

    names = [None, *ADAPTERS]
    for group in (range(4), range(4, 8)):
        # 16 others, each request of the group meeting them at a different point of their lives.
        arrivals: dict[int, list[tuple]] = {}
        for j in range(16):
            start = rng.randrange(len(ids) - 45)
            other = (
                f"o{j}",
                ids[start : start + rng.randrange(2, 45)],
                rng.choice(names),
                rng.randrange(4, 13),
            )
            arrivals.setdefault(rng.choice((0, 0, 1, 2, 4, 7)), []).append(other)
        for k, i in enumerate(group):
            arrivals.setdefault(k * 2, []).append((f"t{i}", targets[i], TARGET_ADAPTERS[i]))
            # The continuation of target i from its first tokens, as another worker would resume it.
            resumed = targets[i] + alone[f"t{i}"].tokens[f"t{i}"][:RESUME_AFTER]
            arrivals.setdefault(k * 2 + 1, []).append(
                (f"c{i}", resumed, TARGET_ADAPTERS[i], NEW_TOKENS - RESUME_AFTER)
            )
        batched = Run(model, adapter_dirs, dtype).until_done(arrivals)
        for i in group:
            want = alone[f"t{i}"]
            assert batched.tokens[f"t{i}"] == want.tokens[f"t{i}"], f"t{i} ({TARGET_ADAPTERS[i]})"
            for step, (got, expected) in enumerate(
                zip(batched.logits[f"t{i}"], want.logits[f"t{i}"], strict=True)
            ):
                assert torch.equal(got, expected), f"t{i} step {step}: {(got - expected).abs().max():.2e}"
            # Re-prefilled: the same next tokens and logits as the undisturbed run.
            assert batched.tokens[f"c{i}"] == want.tokens[f"t{i}"][RESUME_AFTER:], f"c{i}"
            for got, expected in zip(
                batched.logits[f"c{i}"], want.logits[f"t{i}"][RESUME_AFTER:], strict=True
            ):
                assert torch.equal(got, expected), f"c{i}"


def test_deterministic_logits_stay_those_of_transformers_and_peft(loaded, adapter_dirs):
    """fp32: the invariant kernels change roundings, not results (HF fed the engine's tokens)."""
    from peft import PeftModel
    from support.hf_llama import hf_llama

    model = LlamaModel(loaded.config, loaded.weights, torch.float32)
    ids = loaded.tokenizer.encode(TEXT)
    for i, adapter in [(0, "r8-attn"), (1, None), (3, "r64-all")]:
        prompt = ids[i * 3 : i * 3 + 11 + 7 * i]
        run = Run(model, adapter_dirs, torch.float32)
        run.submit("r", prompt, adapter)
        run.until_done()
        base = hf_llama(loaded)
        hf = (base if adapter is None else PeftModel.from_pretrained(base, str(adapter_dirs[adapter]))).eval()
        with torch.no_grad():
            full = torch.tensor([prompt + run.tokens["r"][:-1]])
            reference = hf(full).logits[0, len(prompt) - 1 :].float()
        for step, (ours, theirs) in enumerate(zip(run.logits["r"], reference, strict=True)):
            assert (ours - theirs).abs().max() <= 1e-3, f"{adapter} step {step}"
