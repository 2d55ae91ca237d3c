"""Bytes a tensor-parallel group's driver sends each follower per decode step: the whole plan
against the plan's delta (``services/gpu_worker/executor/plan_delta.py``), side by side.

A real group (``start_group``: rank 0 here, N−1 follower processes, gloo on loopback) serves
``--batch`` requests of ``--prompt-tokens`` tokens each through an :class:`Engine`. Once all of
them decode, every step's bytes are read off the driver's channel (``OpChannel.bytes_sent``: the
pickled operation each follower receives), and the same step's whole :class:`StepPlan` is pickled
beside it, as the channel sent it before deltas (``broadcast_object_list`` of the plan's
operation, pickle's default protocol).

    python -m bench.tp_plan_bytes --tp 3 --batch 32 --prompt-tokens 200 --decode-steps 16
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics

import torch

from services.gpu_worker.engine.engine import Engine, EngineConfig
from services.gpu_worker.engine.request import GenerationRequest
from services.gpu_worker.executor.tp_group import start_group
from services.gpu_worker.model.loading import load_model
from services.runtime.sampling.sampling_params import SamplingParams


def measure(tp: int, batch: int, prompt_tokens: int, decode_steps: int) -> dict:
    loaded = load_model()
    config = EngineConfig(pool_mib=256, max_running=batch, max_prefill_tokens=batch * prompt_tokens)
    executor = start_group(
        loaded.config, loaded.weights, config, tp, model_path="", dtype=torch.float32, device="cpu", threads=2
    )
    whole: list[int] = []
    executed = executor.execute

    def execute(plan):
        whole.append(len(pickle.dumps(("step", plan))))
        return executed(plan)

    executor.execute = execute
    try:
        engine = Engine(executor, config)
        ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * prompt_tokens)
        sampling = SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True)
        for i in range(batch):
            prompt = tuple(ids[i : i + prompt_tokens])
            engine.submit(GenerationRequest(f"request-{i}", prompt, sampling, None), lambda event: None)
        while len(engine.running) < batch or not all(r.output_ids for r in engine.running):
            engine.step()  # the prefills, until every request runs and has its first token
        sent, plans = [], []
        for _ in range(decode_steps):
            before = executor.channel.bytes_sent
            engine.step()
            sent.append(executor.channel.bytes_sent - before)
            plans.append(whole[-1])
        assert len(engine.running) == batch, "every request decodes in every measured step"
    finally:
        executor.close()
    return {
        "tp": tp,
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "decode_steps": decode_steps,
        "whole_plan_bytes_per_step": statistics.median(plans),
        "delta_bytes_per_step": statistics.median(sent),
        "reduction": round(sum(plans) / sum(sent), 1),
        "whole_plan_bytes": plans,
        "delta_bytes": sent,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--decode-steps", type=int, default=16)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.tp, args.batch, args.prompt_tokens, args.decode_steps), indent=2))


if __name__ == "__main__":
    main()
